"""prompt_logprobs and echo with logprobs over HTTP (the openai client and httpx against the tiny engine on
loopback): vLLM's shapes, the numbers against the reference model's full-sequence log_softmax, and the
generated tokens still the reference's greedy ones. lm-eval-harness scores with exactly these requests:
/v1/completions with `echo: true, logprobs: N, max_tokens: 0 or 1`."""

from __future__ import annotations

import json
import random

import httpx
import pytest
from live_server import live_fixtures
from prompt_scores import TOL, reference_logprobs

from mstar.config import EngineConfig
from mstar.engine.async_engine import AsyncEngine
from mstar.engine.core import EngineCore
from mstar.models.kimi_k3.generate import greedy_generate

MODEL = "kimi-k3-plogprobs"


@pytest.fixture(scope="module")
def engine(tiny_model, tokenizer):
    """Chunks of 64 tokens: the prompts below take two or three steps, async scheduling on."""
    cfg = EngineConfig(max_seq_len=256, resources={"mla_kv": {"page_size": 16, "max_num_pages": 96},
                                                   "kda_state": {"max_slots": 5}},
                       scheduler={"max_num_seqs": 4, "max_num_batched_tokens": 64},
                       model_kwargs={"async_scheduling": True})
    engine = AsyncEngine(EngineCore(tiny_model, tokenizer, cfg), MODEL).start()
    yield engine
    engine.shutdown()


server, client = live_fixtures(MODEL, timeout=120)


def words(model, n: int) -> list[int]:
    return [random.randrange(model.config.vocab_size - 256) for _ in range(n)]


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json={"model": MODEL, **body}, timeout=120)


def assert_vllm_prompt_logprobs(model, tokenizer, ids: list[int], got: list, k: int) -> None:
    """vLLM's list: None first, then {token id: {logprob, rank, decoded_token}} of the prompt token and the
    top k (ranks 1..k)."""
    ref = reference_logprobs(model, ids)
    assert len(got) == len(ids) and got[0] is None
    for i in range(1, len(ids)):
        entry, row = got[i], ref[i - 1]
        actual = entry[str(ids[i])]
        want = float(row[ids[i]])
        assert actual["logprob"] == pytest.approx(want, abs=TOL)
        assert int((row >= want + TOL).sum()) <= actual["rank"] <= int((row >= want - TOL).sum())
        assert actual["decoded_token"] == tokenizer.token_bytes(ids[i]).decode("utf-8", errors="replace")
        best = row.topk(k).indices.tolist()
        others = {int(t): e for t, e in entry.items() if int(t) != ids[i]}
        assert len(entry) in (k, k + 1) and len(others) >= k - 1
        for token, e in others.items():
            assert e["logprob"] == pytest.approx(float(row[token]), abs=TOL)
            assert 1 <= e["rank"] <= k
        assert {ids[i], *others} >= set(best[:-1])  # the k best, up to a near tie at the k-th


def test_completion_prompt_logprobs(server, tiny_model, tokenizer):
    ids = words(tiny_model, random.randint(70, 150))
    k = random.randint(1, 5)
    r = post(server, "/v1/completions", {"prompt": ids, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                                         "prompt_logprobs": k, "return_token_ids": True})
    assert r.status_code == 200, r.text
    [choice] = r.json()["choices"]
    assert_vllm_prompt_logprobs(tiny_model, tokenizer, ids, choice["prompt_logprobs"], k)
    assert choice["token_ids"] == greedy_generate(tiny_model, ids, 4)
    assert choice["logprobs"] is None  # logprobs of the output were not asked for


def test_echo_with_logprobs_is_what_lm_eval_reads(client, tiny_model, tokenizer):
    """The loglikelihood request: echo, logprobs 1, max_tokens 1 (and 0). The prompt's tokens lead the
    logprobs (None first), the generated token follows, and the offsets index the returned text."""
    text = "The quick brown fox jumps over the lazy dog, " * random.randint(3, 6)
    ids = tokenizer.encode(text)
    ref = reference_logprobs(tiny_model, ids)
    for max_tokens in (1, 0):
        out = client.completions.create(model=MODEL, prompt=text, echo=True, logprobs=1, max_tokens=max_tokens,
                                        temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})
        [choice] = out.choices
        lp = choice.logprobs
        generated = greedy_generate(tiny_model, ids, 1) if max_tokens else []
        assert choice.token_ids == generated
        assert len(lp.tokens) == len(ids) + len(generated) == len(lp.token_logprobs) == len(lp.text_offset)
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        for i in range(1, len(ids)):
            assert lp.token_logprobs[i] == pytest.approx(float(ref[i - 1, ids[i]]), abs=TOL)
            assert len(lp.top_logprobs[i]) in (1, 2) and lp.tokens[i] in lp.top_logprobs[i]
        assert "".join(lp.tokens[: len(ids)]) == text and choice.text.startswith(text)
        assert lp.text_offset[: len(ids)] == [len("".join(lp.tokens[:i])) for i in range(len(ids))]
        if max_tokens:
            assert lp.text_offset[-1] == len(text) and choice.text == text + tokenizer.decode(generated)
        else:
            assert choice.text == text and out.usage.completion_tokens == 0
        assert choice.model_extra["prompt_logprobs"][0] is None  # vLLM returns what echo computed


def test_echo_with_logprobs_streams_the_prompt_first(server):
    """As in vLLM: the prompt's text and logprobs ride on the first chunk; the chunks add up to the whole."""
    body = {"prompt": "one two three four five six seven eight nine ten", "echo": True, "logprobs": 2,
            "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    whole = post(server, "/v1/completions", body).json()["choices"][0]
    with httpx.stream("POST", server.url + "/v1/completions", json={"model": MODEL, **body, "stream": True},
                      timeout=120) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    text, merged = "", {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for event in events:
        [choice] = event["choices"]
        text += choice["text"]
        for name in merged:
            merged[name] += choice["logprobs"][name]
    assert events[0]["choices"][0]["text"].startswith(body["prompt"])
    assert events[0]["choices"][0]["logprobs"]["token_logprobs"][0] is None
    assert text == whole["text"] and merged == whole["logprobs"]


def test_chat_prompt_logprobs_beside_the_choices(server, tiny_model, tokenizer):
    k = random.randint(0, 3)
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Say something short."}],
                                              "max_tokens": 3, "temperature": 0, "prompt_logprobs": k,
                                              "return_token_ids": True, "n": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    ids = body["prompt_token_ids"]
    assert_vllm_prompt_logprobs(tiny_model, tokenizer, ids, body["prompt_logprobs"], k)
    assert all(c["token_ids"] == greedy_generate(tiny_model, ids, 3)[: len(c["token_ids"])] for c in body["choices"])


def test_refusals_name_the_field(server):
    cases = [({"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs"),
             ({"prompt": "hi", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
             ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
             ({"prompt": "hi", "echo": True, "logprobs": 21}, "logprobs")]
    for body, param in cases:
        r = post(server, "/v1/completions", body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
