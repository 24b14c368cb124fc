"""The incremental K3 output parser against `parse_assistant_output`, on random generated turns cut
into random deltas; and the segmenter's alignment with the engine's (stop-string cut) text."""

from __future__ import annotations

import json
import os
import random

import pytest
from fake_engine import MALFORMED_TOOLS, VALID_TOOLS, shared_tokenizer

from mstar.models.kimi_k3.assistant_output import AssistantOutputParser, parse_assistant_output
from mstar.models.kimi_k3.tokenizer import (
    BOS,
    CLOSE,
    END_OF_MSG,
    EOS,
    OPEN,
    SEP,
    IncrementalDetokenizer,
    Segment,
)
from mstar.server.output_segments import AlignedSegmenter


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return shared_tokenizer(tmp_path_factory)


@pytest.fixture
def rng():
    seed = int.from_bytes(os.urandom(8), "little")
    print(f"random seed {seed}")
    return random.Random(seed)


def _units(tok) -> list[list[int]]:
    """Pieces a random turn is made of: markers, tag texts, plain text (with multi-byte characters
    whose bytes BPE splits), whole tool sections, valid and not."""
    specials = [tok.token_id(name) for name in (OPEN, CLOSE, SEP, END_OF_MSG, EOS, BOS)]
    texts = ["think", "response", "tools", "message", 'call tool="f" index="1"', 'argument key="a" type="string"',
             'argument key="n" type="number"', 'json type="object"', "hello", " ", "\n", "  \n", "42", "é日",
             "😀", '{"k": 1}', "x y", "<|open|>", "tools foo=\"1\""]
    units = [[s] for s in specials] * 3 + [tok.encode(t) for t in texts]
    units += [tok.encode_segments(VALID_TOOLS), tok.encode_segments(MALFORMED_TOOLS)]
    channel = [tok.token_id(OPEN)] + tok.encode("response") + [tok.token_id(SEP)]
    units += [channel, [tok.token_id(CLOSE)] + tok.encode("think") + [tok.token_id(SEP)]]
    return units


def _random_turn(rng: random.Random, units: list[list[int]], tok) -> list[int]:
    """Half the time random units; half the time a well-formed turn with random units spliced in and
    a random cut (so unterminated sections and stray markup occur near real structure)."""
    if rng.random() < 0.5:
        ids: list[int] = []
        for _ in range(rng.randint(0, 14)):
            ids += rng.choice(units)
        return ids
    def markup(marker: str, tag: str) -> list[int]:
        return [tok.token_id(marker)] + tok.encode(tag) + [tok.token_id(SEP)]
    tools = tok.encode_segments(rng.choice([VALID_TOOLS, MALFORMED_TOOLS]))
    parts = [tok.encode("I think"), markup(CLOSE, "think"), markup(OPEN, "response"), tok.encode("Hi é"),
             markup(CLOSE, "response"), tools, markup(CLOSE, "message"), [tok.token_id(END_OF_MSG)]]
    for _ in range(rng.randint(0, 2)):
        parts.insert(rng.randint(0, len(parts)), rng.choice(units))
    ids = [i for part in parts for i in part]
    return ids[: rng.randint(0, len(ids))] if rng.random() < 0.5 else ids


def _stream(tok, ids: list[int], rng: random.Random, thinking: bool, cut_chars: int | None = None):
    """Feed `ids` in random deltas with engine-like text (skip_special, optional stop-string cut);
    return the concatenated reasoning, content, tool calls (without ids), and the released segments."""
    detok = IncrementalDetokenizer(tok, skip_special=True)
    engine_text_sent = 0
    segmenter = AlignedSegmenter(tok)
    parser = AssistantOutputParser(thinking)
    fields = {"reasoning": "", "content": "", "tool_calls": []}
    released: list[Segment] = []
    i = 0
    while i < len(ids):
        step = rng.randint(1, 4)
        delta = ids[i : i + step]
        i += step
        text = detok.push_many(delta)
        if i >= len(ids):
            text += detok.finish()
        if cut_chars is not None:  # the engine cut its text at a stop string
            text = text[: max(0, cut_chars - engine_text_sent)]
        engine_text_sent += len(text)
        segments = segmenter.push(delta, text)
        if i >= len(ids):
            segments += segmenter.finish(cut_by_stop_string=cut_chars is not None)
        released += segments
        pieces = parser.push(segments)
        if i >= len(ids):
            pieces += parser.finish()
        for piece in pieces:
            fields[piece.kind] = fields[piece.kind] + piece.value
    if not ids:
        released += segmenter.finish(cut_by_stop_string=False)
        for piece in parser.finish():
            fields[piece.kind] = fields[piece.kind] + piece.value
    return fields, released


def _without_ids(calls):
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


@pytest.mark.parametrize("thinking", [True, False])
def test_stream_parser_equals_whole_parse(tok, rng, thinking):
    units = _units(tok)
    for _ in range(400):
        ids = _random_turn(rng, units, tok)
        fields, _ = _stream(tok, ids, rng, thinking)
        whole = parse_assistant_output(ids, tokenizer=tok, thinking=thinking)
        assert (fields["reasoning"] or None) == whole.reasoning_content, tok.decode(ids)
        assert (fields["content"] or None) == whole.content, tok.decode(ids)
        assert _without_ids(fields["tool_calls"]) == _without_ids(whole.tool_calls), tok.decode(ids)


def test_stream_parser_emits_text_as_it_arrives(tok):
    parser = AssistantOutputParser(thinking=True)
    assert parser.push([Segment("I wonder")]) == [("reasoning", "I wonder")]
    assert parser.push([Segment(CLOSE, True), Segment("think")]) == []  # waits for <|sep|>
    assert parser.push([Segment(SEP, True), Segment(OPEN, True), Segment("response"), Segment(SEP, True)]) == []
    assert parser.push([Segment("Hi")]) == [("content", "Hi")]
    assert parser.push([Segment(CLOSE, True), Segment("response"), Segment(SEP, True), Segment("\n")]) == []
    tools = tok.decode_segments(tok.encode_segments(VALID_TOOLS))
    pieces = parser.push(tools[:-3])
    assert pieces == []  # the tools section is buffered until it closes
    pieces = parser.push(tools[-3:])
    assert [p.kind for p in pieces] == ["tool_calls"]
    assert [json.loads(c["function"]["arguments"]) for c in pieces[0].value] == [{"city": "Paris", "days": 3},
                                                                                 {"tz": "UTC"}]
    assert parser.finish() == []


def test_segmenter_follows_engine_text_and_stop_cut(tok, rng):
    ids = tok.encode("Hello world") + [tok.token_id(CLOSE)] + tok.encode("think") + [tok.token_id(SEP)]
    ids += tok.encode("after")
    for _ in range(20):
        _, released = _stream(tok, ids, rng, thinking=True, cut_chars=7)  # the stop string began at "orld"
        assert "".join(s.text for s in released) == "Hello w"
    _, released = _stream(tok, ids, rng, thinking=True, cut_chars=11)  # cut right after "world"
    assert "".join(s.text for s in released) == "Hello world<|close|>"  # the marker before the stop string


def test_segmenter_holds_text_the_engine_holds(tok):
    segmenter = AlignedSegmenter(tok)
    ids = tok.encode("abc def")
    assert segmenter.push(ids, "abc") == [Segment("abc")]  # the engine holds " def" back (a stop prefix?)
    assert segmenter.push([], "") == []
    assert "".join(s.text for s in segmenter.finish(cut_by_stop_string=False)) == " def"
