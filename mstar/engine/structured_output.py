"""Structured outputs: a grammar (JSON Schema, regex, choice, Lark) that constrains a request's tokens.

The grammar engine is llguidance (chosen over xgrammar: an abi3 wheel of 3 MB with no Python
dependencies, JSON Schema and Rust-regex coverage; benchmarks/grammar_mask.py measures its mask cost).
Its token vocabulary is built once per engine from the K3 tiktoken encoding.

Each step, a request with a grammar gets a packed bitmask row (32 tokens per int32 word) computed on
the host from its matcher, uploaded once for the step, and applied on the device to its logits row
before the token is chosen (greedy rows too): tokens the grammar forbids get -inf. Its matcher is
advanced with each accepted token, and a request whose grammar is complete stops with "stop".

With DSpark, a grammar request's verify block [anchor, d_1..d_k] gets one row per position: row j the
mask after d_1..d_j, from a copy of the matcher advanced through the drafts (the request's own matcher
moves only by the tokens verification keeps, when they are appended). Verification (greedy or
sampled) then judges each draft by masked target logits: a draft the grammar forbids has probability
0 there and is rejected, the correction or bonus token is one the grammar allows, and what a greedy
request emits is what the non-speculative constrained loop emits. Once a draft is forbidden the rows
after it cannot be reached (that draft is rejected); they repeat the last mask, so every row stays finite.
"""

from __future__ import annotations

from dataclasses import dataclass

import llguidance
import llguidance.numpy
import torch
from llguidance.tiktoken import lltokenizer_from_encoding

from mstar.engine.params import ParamError

_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Grammar:
    """What a request's output must match. `field` is the request field it came from (for a 400)."""

    kind: str  # "json_schema", "json_object", "regex", "lark" (a choice is a regex: choice_grammar)
    source: str  # the schema as JSON text, the regex, or the Lark grammar
    field: str

    def to_llguidance(self) -> str:
        # JSON as `json.dumps` writes it (", " and ": ", no other whitespace): a model cannot pad it with
        # whitespace up to max_tokens; a schema's "x-guidance" options override this
        if self.kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(self.source, defaults=_JSON_OPTIONS)
        if self.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.source)
        return llguidance.LLMatcher.grammar_from_lark(self.source)


def choice_grammar(choices: list[str], field: str) -> Grammar:
    """The output is exactly one of `choices` (vLLM's guided_choice: the bare text, no quotes)."""
    if not choices or not all(isinstance(c, str) for c in choices):
        raise ParamError(f"{field} must be a non-empty list of strings")
    alternatives = "|".join(_regex_literal(c) for c in choices)
    return Grammar("regex", f"({alternatives})", field)


def _regex_literal(text: str) -> str:
    return "".join("\\" + c if c in r".^$*+?()[]{}|\/-" else c for c in text)


class GrammarCompiler:
    """Checks grammars and makes their matchers, against the engine's token vocabulary (built once)."""

    def __init__(self, encoding, vocab_size: int, stop_ids: tuple[int, ...]):
        self.vocab_size = vocab_size
        self.tokenizer = lltokenizer_from_encoding(encoding, n_vocab=vocab_size, eos_token=list(stop_ids))

    def _grammar(self, grammar: Grammar) -> str:
        try:
            return grammar.to_llguidance()
        except ValueError as err:
            raise ParamError(f"{grammar.field} is not a valid {grammar.kind}: {err}") from None

    def check(self, grammar: Grammar) -> None:
        error = llguidance.LLMatcher.validate_grammar(self._grammar(grammar), self.tokenizer)
        if error:
            raise ParamError(f"{grammar.field} is not a valid {grammar.kind}: {error.strip()}")

    def matcher(self, grammar: Grammar) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self.tokenizer, self._grammar(grammar), log_level=0)
        if matcher.is_error():
            raise ParamError(f"{grammar.field} is not a valid {grammar.kind}: {matcher.get_error()}")
        return matcher

    def bitmask(self, blocks: list[tuple[llguidance.LLMatcher, list[int]]], device: torch.device) -> torch.Tensor:
        """[sum of 1 + len(drafts), ceil(V / 32)] int32 on the device, for (matcher, drafts) blocks: a block's
        row j holds the tokens allowed after its first j drafts (module doc); bit t % 32 of word t // 32 is
        set if token t is allowed. The matchers themselves are not advanced."""
        words = (self.vocab_size + 31) // 32
        rows = sum(1 + len(drafts) for _, drafts in blocks)
        mask = torch.empty((rows, words), dtype=torch.int32, pin_memory=device.type == "cuda")
        # llguidance.numpy, not .torch: the same fill, but llguidance.torch defines a torch.compile'd function,
        # and importing it loads dynamo and inductor (~2.5 s in every process that imports the engine).
        words_view = mask.numpy()
        row = 0
        for matcher, drafts in blocks:
            llguidance.numpy.fill_next_token_bitmask(matcher, words_view, row)
            filled = 1
            # a copy, not consume-then-rollback: a consumed stop token is not counted by llguidance's rollback
            probe = matcher.deep_copy() if drafts else None
            for token in drafts:
                if not probe.consume_token(token):  # forbidden here: this draft is rejected, the rest unreachable
                    break
                llguidance.numpy.fill_next_token_bitmask(probe, words_view, row + filled)
                filled += 1
            words_view[row + filled : row + 1 + len(drafts)] = words_view[row + filled - 1]
            row += 1 + len(drafts)
        return mask.to(device, non_blocking=True)


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """fp32 [N, V] logits with the tokens each of `rows` forbids (its bit in `bitmask` clear) at -inf."""
    logits = logits.float()
    vocab = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :vocab].bool()
    masked = logits[rows].masked_fill(~allowed, float("-inf"))
    return logits.index_copy(0, rows, masked)
