"""K3 tokenizer on a tiny BPE trained here from stdlib source: file layout, special slots, text
round-trips, injection safety and streaming detokenization. Random text is fresh each run."""

from __future__ import annotations

import base64
import json
import os
import random

import pytest

from mstar.models.kimi_k3.tokenizer import (
    K3_NAMED_SPECIALS,
    K3_NUM_RANKS,
    NUM_SPECIAL_SLOTS,
    IncrementalDetokenizer,
    KimiTokenizer,
    Segment,
    k3_special_names,
    read_tiktoken_ranks,
)
from mstar.tools.train_bpe import (
    encode_with_ranks,
    stdlib_corpus,
    train_bpe_ranks,
    train_tiny_tokenizer,
    write_tokenizer_dir,
)

NUM_RANKS = 1024


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return train_tiny_tokenizer(tmp_path_factory.mktemp("k3tok"), num_ranks=NUM_RANKS)


@pytest.fixture(scope="module")
def tok(tok_dir):
    return KimiTokenizer.from_dir(tok_dir)


@pytest.fixture
def rng():
    seed = int.from_bytes(os.urandom(8), "little")
    print(f"random seed {seed}")
    return random.Random(seed)


_ALPHABETS = [
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789",
    " \t\n\r  ",
    "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~",
    "éèêëàâäôöûüçñßÀÉÎÕØÅÆœ",
    "αβγδεζηθλμπσωΑΒΓΔЖЗИЙКЛМнопрст",
    "你好世界中文字符测试漢字",
    "こんにちはカタカナ한국어",
    "😀🚀🎉👍🏽👨‍👩‍👧🇫🇷✨🔥",
    "\u0301\u0308\u200d\ufe0f",
]


def random_text(rng: random.Random, max_len: int = 60) -> str:
    chars = []
    for _ in range(rng.randint(0, max_len)):
        if rng.random() < 0.1:  # any scalar value, surrogates excluded
            code = rng.randint(1, 0x10FFFF)
            if 0xD800 <= code <= 0xDFFF:
                code = 0x1F600
            chars.append(chr(code))
        else:
            chars.append(rng.choice(rng.choice(_ALPHABETS)))
    return "".join(chars)


# ---- file layout ---------------------------------------------------------------------------


def test_tiktoken_model_layout(tok_dir):
    lines = (tok_dir / "tiktoken.model").read_text(encoding="ascii").splitlines()
    assert len(lines) == NUM_RANKS
    parsed = []
    for line in lines:
        token_b64, rank = line.split(" ")
        parsed.append((base64.b64decode(token_b64, validate=True), int(rank)))
    assert [rank for _, rank in parsed] == list(range(NUM_RANKS))
    assert [token for token, _ in parsed[:256]] == [bytes([b]) for b in range(256)]
    assert len({token for token, _ in parsed}) == NUM_RANKS
    assert read_tiktoken_ranks(tok_dir / "tiktoken.model") == dict(parsed)


def test_tokenizer_config_names_k3_specials_at_k3_offsets(tok_dir):
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    decoder = {int(k): v for k, v in config["added_tokens_decoder"].items()}
    # Like K3's real config: only the named slots are listed, at the same offsets after the ranks.
    assert {i - NUM_RANKS: v["content"] for i, v in decoder.items()} == K3_NAMED_SPECIALS
    for entry in decoder.values():
        assert entry["special"] == (entry["content"] not in ("<|open|>", "<|close|>", "<|sep|>"))
    special_map = json.loads((tok_dir / "special_tokens_map.json").read_text())
    assert special_map["bos_token"] == "[BOS]" and special_map["pad_token"] == "[PAD]"


def test_config_can_list_all_256_slots(tmp_path, tok_dir):
    ranks = read_tiktoken_ranks(tok_dir / "tiktoken.model")
    write_tokenizer_dir(tmp_path, ranks, name_reserved_slots=True)
    decoder = json.loads((tmp_path / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    ids = sorted(int(k) for k in decoder)
    assert ids == list(range(NUM_RANKS, NUM_RANKS + NUM_SPECIAL_SLOTS))
    assert decoder[str(NUM_RANKS + 8)]["content"] == f"<|reserved_token_{NUM_RANKS + 8}|>"
    full = KimiTokenizer.from_dir(tmp_path)
    short = KimiTokenizer.from_dir(tok_dir)
    assert full.special_names == short.special_names


def test_real_k3_special_ids():
    names = k3_special_names(K3_NUM_RANKS)
    by_name = {name: i for i, name in names.items()}
    expected = {
        "[BOS]": 163584, "[EOS]": 163585, "<|end_of_msg|>": 163586, "<|open|>": 163587, "<|close|>": 163588,
        "<|sep|>": 163589, "[start_header_id]": 163590, "[end_header_id]": 163591, "[EOT]": 163593,
        "<|media_begin|>": 163602, "<|media_content|>": 163603, "<|media_end|>": 163604, "<|media_pad|>": 163605,
        "<osagent_mode>": 163649, "[UNK]": 163838, "[PAD]": 163839,
    }  # fmt: skip
    for name, token_id in expected.items():
        assert by_name[name] == token_id
    assert names[163592] == "<|reserved_token_163592|>"
    assert sorted(names) == list(range(163584, 163840))


def test_special_ids_names_and_properties(tok):
    assert tok.num_ranks == NUM_RANKS
    assert tok.vocab_size == NUM_RANKS + NUM_SPECIAL_SLOTS
    assert sorted(tok.special_names) == list(range(NUM_RANKS, tok.vocab_size))
    for offset, name in K3_NAMED_SPECIALS.items():
        assert tok.token_id(name) == NUM_RANKS + offset
        assert tok.special_names[NUM_RANKS + offset] == name
    for i in range(NUM_RANKS, tok.vocab_size):
        if i - NUM_RANKS not in K3_NAMED_SPECIALS:
            assert tok.special_names[i] == f"<|reserved_token_{i}|>"
    assert tok.eos_id == tok.token_id("<|end_of_msg|>") == NUM_RANKS + 2
    assert tok.bos_id == NUM_RANKS and tok.pad_id == NUM_RANKS + 255 and tok.unk_id == NUM_RANKS + 254
    assert set(tok.stop_ids) == {tok.token_id("<|end_of_msg|>"), tok.token_id("[EOS]")}
    with pytest.raises(KeyError, match="not a special token"):
        tok.token_id("<|im_end|>")


# ---- encoding ------------------------------------------------------------------------------


def test_random_unicode_round_trip(tok, rng):
    for _ in range(300):
        text = random_text(rng)
        ids = tok.encode(text)
        assert all(0 <= i < tok.num_ranks for i in ids)
        assert tok.decode(ids) == text


def test_split_regex_of_trainer_matches_tiktoken(tok, tok_dir, rng):
    # The trainer splits with Python's `regex`; the tokenizer with tiktoken's Rust engine. Same ids
    # from a pure-Python BPE over the trainer's split means the two splits agree.
    ranks = read_tiktoken_ranks(tok_dir / "tiktoken.model")
    for _ in range(300):
        text = random_text(rng)
        assert tok.encode(text) == encode_with_ranks(text, ranks), repr(text)


def test_trained_merges_are_used(tok):
    text = "def __init__(self):\n        return self\n"
    assert len(tok.encode(text)) < len(text.encode("utf-8")) / 2


def test_special_looking_text_never_becomes_special(tok, rng):
    names = list(tok.special_names.values())
    for _ in range(50):
        parts = [random_text(rng, 8) for _ in range(6)]
        text = "".join(p + rng.choice(names) for p in parts)
        ids = tok.encode(text)
        assert not any(tok.is_special(i) for i in ids)
        assert tok.decode(ids) == text
        assert tok.encode_segments([Segment(text)]) == ids
        assert tok.encode_segments([text]) == ids


def test_encode_segments_controls_and_boundaries(tok):
    open_, sep = tok.token_id("<|open|>"), tok.token_id("<|sep|>")
    segments = [
        Segment("<|open|>", control=True),
        Segment("message"),
        Segment(" role"),
        Segment('="'),
        Segment("user"),
        Segment('"'),
        Segment("<|sep|>", control=True),
    ]
    expected = [
        open_,
        *tok.encode("message"),
        *tok.encode(" role"),
        *tok.encode('="'),
        *tok.encode("user"),
        *tok.encode('"'),
        sep,
    ]
    assert tok.encode_segments(segments) == expected
    # A control segment may mix names and text; the names become ids, the text stays text.
    mixed = tok.encode_segments([Segment("<|media_begin|>image 4x4<|media_end|>", control=True)])
    assert mixed == [tok.token_id("<|media_begin|>"), *tok.encode("image 4x4"), tok.token_id("<|media_end|>")]


def test_decode_specials(tok):
    ids = [tok.token_id("<|open|>"), *tok.encode("hi"), tok.eos_id]
    assert tok.decode(ids) == "<|open|>hi<|end_of_msg|>"
    assert tok.decode(ids, skip_special=True) == "hi"
    segments = tok.decode_segments(ids)
    assert segments == [Segment("<|open|>", control=True), Segment("hi"), Segment("<|end_of_msg|>", control=True)]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([tok.vocab_size])


def test_long_runs_round_trip(tok, rng):
    text = "a" * 30_000 + " " * 26_000 + random_text(rng) + "\n" * 25_001
    assert tok.decode(tok.encode(text)) == text


# ---- streaming detokenization --------------------------------------------------------------


def test_incremental_equals_full_decode(tok, rng):
    for _ in range(100):
        ids = tok.encode(random_text(rng))
        if ids and rng.random() < 0.5:
            ids.insert(rng.randrange(len(ids) + 1), tok.token_id("<|sep|>"))
        for skip in (False, True):
            detok = IncrementalDetokenizer(tok, skip_special=skip)
            deltas = [detok.push(i) for i in ids]
            deltas.append(detok.finish())
            assert "".join(deltas) == detok.text == tok.decode(ids, skip_special=skip)
            assert not any("\ufffd" in d for d in deltas) or "\ufffd" in tok.decode(ids)


def test_incremental_split_at_every_byte_boundary(tok, rng):
    # Ranks 0..255 are the single bytes, so feeding the UTF-8 bytes one id at a time cuts every
    # multi-byte character at every possible place.
    for _ in range(30):
        text = random_text(rng, 30)
        detok = IncrementalDetokenizer(tok)
        deltas = [detok.push(b) for b in text.encode("utf-8")]
        deltas.append(detok.finish())
        assert all("\ufffd" not in d for d in deltas) or "\ufffd" in text
        assert "".join(deltas) == text
        # Characters come out as soon as their last byte arrives.
        assert sum(len(d) for d in deltas[:-1]) == len(text)


def test_incremental_flushes_incomplete_tail(tok):
    ids = [*tok.encode("ok "), 0xE4, 0xB8]  # first two bytes of a 3-byte character
    detok = IncrementalDetokenizer(tok)
    streamed = "".join(detok.push(i) for i in ids)
    assert streamed == "ok "
    assert detok.finish() == "\ufffd"
    assert detok.text == tok.decode(ids)


# ---- trainer and loader ----------------------------------------------------------------------


def test_training_is_deterministic():
    corpus = stdlib_corpus(60_000)
    first = train_bpe_ranks(corpus, 400)
    second = train_bpe_ranks(list(corpus), 400)
    assert first == second
    assert len(first) == 400
    assert all(first[bytes([b])] == b for b in range(256))


def test_loader_errors(tmp_path, tok_dir):
    with pytest.raises(FileNotFoundError, match="tiktoken.model"):
        KimiTokenizer.from_dir(tmp_path)
    ranks = read_tiktoken_ranks(tok_dir / "tiktoken.model")
    write_tokenizer_dir(tmp_path, ranks)
    config_path = tmp_path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["added_tokens_decoder"]["5"] = {"content": "<|bad|>"}
    config_path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="outside the special slots"):
        KimiTokenizer.from_dir(tmp_path)
    (tmp_path / "tiktoken.model").write_text("not-base64!! x\n")
    with pytest.raises(ValueError, match="cannot parse"):
        KimiTokenizer.from_dir(tmp_path)
