"""The soak test in its shortened form: `mstar-soak` (mstar/tools/soak.py) serves the tiny config
on loopback and drives 80 mixed requests at it (streams and not, long prompts, n > 1, stop
strings, clients that leave, and hostile clients: extreme sampling values, nested tool arguments,
huge bodies, disconnects mid-body, headers and bodies sent a byte at a time) from more clients
than the server admits (so 429s are retried),
checking every answer against the greedy reference. Nothing may be lost, and the pools must be
empty at the end. The full run is documented in the README
("Operating the server") with its command."""

from __future__ import annotations

from paths import ROOT

from mstar.tools.soak import Job, check_whole, format_summary, make_plan, percentile, soak_config

CONFIG = ROOT / "configs" / "kimi_k3_tiny.yaml"


def test_short_soak_loses_nothing(tiny_dir, capsys):
    # 16 clients against a bound of 8 running + 4 waiting generations: some get a 429 and retry.
    summary = soak_config(CONFIG, [f"checkpoint={tiny_dir}", "max_seq_len=1024", "resources.mla_kv.max_num_pages=512",
                                   "scheduler.max_num_batched_tokens=256", "scheduler.max_num_seqs=8",
                                   "scheduler.max_waiting=4", "server.header_timeout_s=2", "server.body_timeout_s=2"],
                          requests=80, duration_s=45, concurrency=16, seed=None, request_timeout_s=60,
                          hostile=True, log=lambda _: None)
    with capsys.disabled():
        print("\nsoak (short):\n" + format_summary(summary))
    assert summary["lost"] == 0, summary["problems"]
    assert summary["completed"] + summary["aborted_as_planned"] == summary["issued"]
    assert summary["issued"] + summary["not_sent"] == 80 and summary["issued"] >= 60
    assert summary["pools_empty"], summary["pools"]
    assert summary["aborted_as_planned"] > 0 and summary["latency_p99_s"] >= summary["latency_p50_s"] > 0
    assert summary["retries_429"] > 0  # the bound held, and every refused request got through on retry


def test_plan_mixes_every_kind_and_prompts_are_distinct():
    jobs = make_plan(300, seed=1)
    assert {j.kind for j in jobs} == {"complete", "complete_stream", "long", "chat", "chat_stream", "n_greedy",
                                      "n_sampled", "stop", "abort_stream", "abort_wait"}
    hostile = {j.kind for j in make_plan(300, seed=1, hostile=True)}
    assert {"extreme_sampling", "nested_tools", "huge_body", "disconnect_body", "slow_headers", "slow_body"} <= hostile
    assert len({j.text for j in jobs}) == len(jobs)
    assert any(j.n > 1 for j in jobs) and any(j.stream for j in jobs) and any(not j.stream for j in jobs)


def test_checks_catch_a_truncated_or_crossed_answer():
    class Response:
        status_code = 200

        def __init__(self, body):
            self._body = body

        def json(self):
            return self._body

    class Tok:
        @staticmethod
        def decode(ids, skip_special=False):
            return "".join(chr(65 + i % 26) for i in ids)

    from mstar.tools.soak import Expected

    job = Job(index=0, kind="complete", text="p", max_tokens=3, stream=False)
    expected = Expected(prompt_ids=[5, 6], reference=[1, 2, 3])

    def body(ids, prompt=(5, 6)):
        return {"choices": [{"index": 0, "text": Tok.decode(ids), "token_ids": ids, "prompt_token_ids": list(prompt),
                             "finish_reason": "length"}],
                "usage": {"prompt_tokens": 2, "completion_tokens": len(ids), "total_tokens": 2 + len(ids)}}

    assert check_whole(job, expected, Response(body([1, 2, 3])), Tok) == []
    assert check_whole(job, expected, Response(body([1, 2])), Tok)  # truncated
    assert check_whole(job, expected, Response(body([1, 2, 3, 3])), Tok)  # duplicated
    assert check_whole(job, expected, Response(body([1, 2, 4])), Tok)  # someone else's continuation
    assert check_whole(job, expected, Response(body([1, 2, 3], prompt=(7,))), Tok)  # someone else's prompt
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0 and percentile([1.0] * 99 + [9.0], 99) == 1.0
