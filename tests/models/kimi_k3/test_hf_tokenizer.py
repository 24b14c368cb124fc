"""The fast-tokenizer file beside K3's tiktoken BPE: `transformers.AutoTokenizer` loads the folder
offline (no remote code) and gives our ids, on training-corpus text, on text outside it, and for
every special token."""

from __future__ import annotations

import random

import pytest
from paths import ROOT

from mstar.models.kimi_k3 import tokenizer
from mstar.models.kimi_k3.tokenizer import KimiTokenizer
from mstar.training.corpus import read_source, stdlib_files

MINI = ROOT / "models" / "kimi_k3_mini"
# (Text that spells a special token is one difference: `transformers` takes it as the special id,
# `KimiTokenizer.encode` as text; prompts with markup are built from segments, never from such text.)
EXTRA = ["Hello 世界, naïve café 😀 — don'T   \n\n\t  x = 1234567;", "ÀÉÎ Straße ΑΒΓ İı ǅ", "\r\n\r\n   ", ""]


def corpus_sample(count: int) -> list[str]:
    """`count` random standard-library files (what the tokenizers were trained on) plus text outside it. Not files
    that `KimiTokenizer` cuts before encoding, as `tokenization_kimi.py` does (over 400,000 characters, or a run of
    over 25,000): the fast tokenizer encodes them whole, so ids may differ at a cut (pydoc_data/topics.py did:
    a run of spaces across the 400,000th character)."""
    files = [p for p in stdlib_files() if (t := read_source(p)) is not None and not cut_before_encoding(t)]
    return [read_source(p) for p in random.sample(files, count)] + EXTRA


def cut_before_encoding(text: str) -> bool:
    return len(text) > tokenizer._MAX_ENCODE_CHARS or tokenizer._LONG_RUN.search(text) is not None


@pytest.fixture(scope="module", params=["tiny", "mini"])
def folder(request, tiny_dir):
    return tiny_dir if request.param == "tiny" else MINI


def test_auto_tokenizer_loads_offline_and_matches_our_ids(folder, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(folder)
    ours = KimiTokenizer.from_dir(folder)
    assert len(hf) == ours.vocab_size
    for text in corpus_sample(25):
        ids = ours.encode(text)
        assert hf.encode(text, add_special_tokens=False) == ids
        # K3 adds no special tokens to text (no BOS): vLLM's add_special_tokens gives the same ids either way,
        # which is how the server honours it (server/protocol.py)
        assert hf.encode(text, add_special_tokens=True) == ids
        assert hf.decode(ids) == ours.decode(ids)
    for token_id, name in ours.special_names.items():
        assert hf.convert_tokens_to_ids(name) == token_id
        assert hf.convert_ids_to_tokens(token_id) == name
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (ours.bos_id, ours.token_id("[EOS]"), ours.pad_id)
