"""`mstar-roofline CONFIG --tp 8`: the floor of one engine step on one rank of an H200.

    mstar-roofline kimi_k3_pruned75_config.json --tp 8 --batch 1,8,16,32,64 --drafts 4,7 --prefill 1024,8192

For a decode step (B requests, one new row each, L tokens of context per request), a verify step
(B requests of k+1 rows: the anchor and k drafts) and a prefill (T tokens of one request, or of a
batch of them) it counts what one rank must move and compute, and divides by the H200's measured
copy bandwidth and bf16 matrix rate: the larger of the two times is the floor, and which one it is
says whether the step is bound by bytes or by arithmetic (/work/.library/device/METHOD.md).

Bytes, per rank, each read once and each output written once:
- weights: the rank's non-expert weights (`rank_weight_bytes`), except that of the embedding only
  the rows of the step's tokens are read (every rank gathers one row per token: `VocabParallelEmbedding`
  looks up row 0 for ids outside its slice); the lm_head slice is read whole.
- experts: the routed experts the step's tokens touch, at the bytes of the rank's slice (MXFP4:
  packed nibbles and E8M0 scales). Under uniform top-k routing a held expert is missed by one token
  with probability 1 - k/E, so N tokens touch E_rank * (1 - (1 - k/E)^N) of the E_rank held.
- KV: the MLA latent cache, replicated on every rank (sharding.py): the context rows are read and the
  new rows written, kv_lora_rank + rope values per token and MLA layer in the model dtype.
- KDA state: per request and KDA layer, the recurrent state (the rank's heads, K x V in fp32) and
  the short-conv windows (3 x (W-1) x the rank's channels, model dtype), read (unless the request
  starts from zero) and written back.
FLOPs, per rank:
- GEMMs: 2 per weight per row for every non-expert weight but the embedding (a gather); the lm_head
  only for the sampled rows (every row of decode and verify, the last of a prefill). Routed experts:
  only the active ones, top_k * E_rank / E slices per token. The count includes the norm and conv
  weights (each also one multiply-add per row), well under 1% of it.
- MLA attention in the absorbed form mstar runs for every step (`serving.py`): per (query, cached
  row) pair and head, scores over kv_lora_rank + rope values and values over kv_lora_rank. A request
  of q new rows after L cached attends q*L + q(q+1)/2 pairs (causal: T(T+1)/2 for a prefill).
- KDA: decode and verify rows take the recurrent update, a prefill the chunked form (`kda_flops`).

Left out, all small against what is counted or off the HBM path: activations (the residual stream
and the AttnRes blocks it re-reads: about 1% of the bytes at decode batch 64; prefill is FLOP-bound
by far), attention softmax and gate arithmetic, the all-reduces (NVLink), and the pending-prefix
replay of speculative decoding (recurrent_pool.py: at most k+1 rows per request re-run through the
KDA layers and their inputs kept, the cost of never rolling the state back).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path

import torch

from mstar.distributed.sharding import ShardingPlan
from mstar.distributed.weight_bytes import WeightBytes, rank_weight_bytes
from mstar.models.kimi_k3.config import KimiK3Config, load_config, parse_config

# Ceilings of one H200, measured on this workplace's machines (/work/.library/device/KINDS.md,
# 2026-10-28 and 11-04), not the datasheet's 4.8 TB/s and ~990 TFLOP/s:
# a large device-to-device copy moved ~4.3 TB/s counting bytes read plus bytes written;
HBM_BYTES_PER_S = 4.3e12
# an 8192^3 bf16 matrix product on random data ran at 769-798 TFLOP/s (700-790 elsewhere); 750 is a
# rate a whole model's GEMMs of mixed shapes can reach at best.
BF16_FLOPS_PER_S = 7.5e14

KDA_CHUNK = 64  # fla's chunk_kda chunk size (kda_fla.py runs it for prefill)
GB, TFLOP, US = 1e9, 1e12, 1e-6


@dataclass(frozen=True)
class RankModel:
    """What one rank holds that a step's cost depends on."""

    config: KimiK3Config  # the rank's config: heads and intermediate sizes / tp
    weights: WeightBytes
    num_experts: int  # E: the experts routing picks from
    experts_held: int  # E_rank: the experts this rank holds a slice of
    dtype: torch.dtype  # weights, latent cache and conv windows; the KDA state is at least fp32

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    def count(self, kind: str) -> int:
        return self.config.layer_kinds.count(kind)


def rank_model(config: KimiK3Config, plan: ShardingPlan, dtype: torch.dtype = torch.bfloat16) -> RankModel:
    """Rank `plan.rank`'s share of `config`, weights as loaded from an MXFP4 checkpoint in `dtype`."""
    sharding = plan.expert_sharding(config)
    return RankModel(plan.rank_config(config), rank_weight_bytes(config, plan, dtype=dtype), config.num_experts,
                     len(sharding.local_experts), dtype)


def expected_distinct_experts(held: int, num_experts: int, top_k: int, tokens: int) -> float:
    """Expected number of the `held` experts that `tokens` tokens touch, each routed uniformly to
    `top_k` distinct experts of `num_experts` (so one token misses a given expert w.p. 1 - k/E)."""
    return held * (1 - (1 - top_k / num_experts) ** tokens)


def attention_pairs(batch: int, rows: int, context: int) -> int:
    """(query, key) pairs of `batch` requests of `rows` new rows after `context` cached, causal."""
    return batch * (rows * context + rows * (rows + 1) // 2)


def kda_flops(head_dim: int, chunked: bool) -> float:
    """FLOPs of one token in one KDA head (K = V = head_dim), past its projections.

    Recurrent (one row at a time): decay the K x V state (KV), S^T k (2KV), the rank-one delta update
    (2KV), o = S^T q (2KV): 7KV. Chunked (chunks of C rows): three state products per token (w S,
    q S, k^T v_new: 6KV), the intra-chunk C x C products (k k^T, q k^T, A k, A v, A_qk v_new:
    C(6K + 4V) per token) and the triangular solve of the C x C system (C^2/3 per token)."""
    k = v = head_dim
    if not chunked:
        return 7 * k * v
    c = KDA_CHUNK
    return 6 * k * v + c * (6 * k + 4 * v) + c * c / 3


@dataclass(frozen=True)
class Floor:
    """One step on one rank: what it moves and computes, and the time that costs at best."""

    step: str  # "decode", "verify k=4", "prefill"
    batch: int  # requests
    tokens: int  # rows fed (batch x rows per request)
    context: int  # tokens cached per request before the step
    weight_bytes: float  # non-expert weights (embedding: the tokens' rows only)
    expert_bytes: float  # routed experts touched
    kv_bytes: float  # MLA latent cache read and written
    kda_bytes: float  # KDA recurrent state and conv windows read and written
    gemm_flops: float  # weights (non-expert, lm_head on sampled rows, active experts)
    mla_flops: float  # absorbed attention over the context
    kda_flops: float  # recurrent or chunked KDA past its projections

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.expert_bytes + self.kv_bytes + self.kda_bytes

    @property
    def flops(self) -> float:
        return self.gemm_flops + self.mla_flops + self.kda_flops

    @property
    def byte_floor_s(self) -> float:
        return self.bytes / HBM_BYTES_PER_S

    @property
    def flop_floor_s(self) -> float:
        return self.flops / BF16_FLOPS_PER_S

    @property
    def floor_s(self) -> float:
        return max(self.byte_floor_s, self.flop_floor_s)

    @property
    def bound(self) -> str:
        return "bytes" if self.byte_floor_s >= self.flop_floor_s else "FLOPs"

    def as_dict(self) -> dict[str, float | int | str]:
        derived = ("bytes", "flops", "byte_floor_s", "flop_floor_s", "floor_s", "bound")
        return asdict(self) | {name: getattr(self, name) for name in derived}


def step_floor(rank: RankModel, step: str, batch: int, rows: int, context: int, *, sampled_rows: int,
               chunked_kda: bool) -> Floor:
    """The floor of `batch` requests each feeding `rows` rows after `context` cached tokens, of
    which `sampled_rows` per request go through the lm_head."""
    if batch < 1 or rows < 1 or context < 0:
        raise ValueError(f"a step needs batch >= 1, rows >= 1 and context >= 0 (got {batch}, {rows}, {context})")
    cfg, w, size = rank.config, rank.weights, rank.itemsize
    tokens = batch * rows
    la = cfg.linear_attn
    heads_kda, heads_mla = la.num_heads, cfg.num_attention_heads  # the rank's heads

    # one embedding row per token (never more than the slice holds)
    weight_bytes = w.other - w.embedding + min(tokens * cfg.hidden_size * size, w.embedding)
    touched = expected_distinct_experts(rank.experts_held, rank.num_experts, cfg.num_experts_per_token, tokens)
    expert_bytes = w.experts * touched / rank.experts_held
    kv_bytes = rank.count("mla") * cfg.kv_cache_width * size * (batch * context + tokens)
    state_bytes = heads_kda * la.head_dim**2 * torch.promote_types(rank.dtype, torch.float32).itemsize
    conv_bytes = 3 * (la.short_conv_kernel_size - 1) * la.width * size
    passes = 2 if context else 1  # read and written back; a fresh request's state is only written
    kda_bytes = rank.count("kda") * batch * (state_bytes + conv_bytes) * passes

    per_row_weights = (w.other - w.embedding - w.lm_head) / size  # every row multiplies these
    # per MoE layer a token's top_k experts are held here w.p. E_rank / E, each a slice of
    # expert_weights / (layers * E_rank) weights: top_k * expert_weights / E over all MoE layers
    active_expert_weights = cfg.num_experts_per_token * w.expert_weights / rank.num_experts
    gemm_flops = 2 * (tokens * (per_row_weights + active_expert_weights)
                      + batch * sampled_rows * w.lm_head / size)
    mla_flops = (rank.count("mla") * 2 * heads_mla * (cfg.kv_cache_width + cfg.kv_lora_rank)
                 * attention_pairs(batch, rows, context))
    kda = rank.count("kda") * heads_kda * tokens * kda_flops(la.head_dim, chunked_kda)
    return Floor(step, batch, tokens, context, weight_bytes, expert_bytes, kv_bytes, kda_bytes, gemm_flops,
                 mla_flops, kda)


def decode_floor(rank: RankModel, batch: int, context: int) -> Floor:
    return step_floor(rank, "decode", batch, 1, context, sampled_rows=1, chunked_kda=False)


def verify_floor(rank: RankModel, batch: int, drafts: int, context: int) -> Floor:
    """`batch` requests of k+1 rows (the anchor token and `drafts` drafts), every row sampled."""
    return step_floor(rank, f"verify k={drafts}", batch, drafts + 1, context, sampled_rows=drafts + 1,
                      chunked_kda=False)


def prefill_floor(rank: RankModel, tokens: int, batch: int = 1) -> Floor:
    """`batch` fresh requests of `tokens` prompt tokens each; only the last row is sampled."""
    return step_floor(rank, "prefill", batch, tokens, 0, sampled_rows=1, chunked_kda=True)


def mixed_floor(rank: RankModel, chunk: int, decode_batch: int, context: int) -> Floor:
    """One fresh request's prompt chunk of `chunk` tokens and `decode_batch` requests decoding one row each after
    `context` cached tokens, in one step (a mixed step): the weights read once and the experts all its tokens
    touch, each part's cache and state traffic and FLOPs (the chunk's last row and every decode row sampled)."""
    prefill, decode = prefill_floor(rank, chunk), decode_floor(rank, decode_batch, context)
    whole = step_floor(rank, "mixed", 1, chunk + decode_batch, 0, sampled_rows=1, chunked_kda=True)
    return Floor(f"mixed {chunk}+{decode_batch}", 1 + decode_batch, chunk + decode_batch, context,
                 whole.weight_bytes, whole.expert_bytes, prefill.kv_bytes + decode.kv_bytes,
                 prefill.kda_bytes + decode.kda_bytes, prefill.gemm_flops + decode.gemm_flops,
                 prefill.mla_flops + decode.mla_flops, prefill.kda_flops + decode.kda_flops)


# --- the CLI ------------------------------------------------------------------------------------


def resolve_config(name: str) -> KimiK3Config:
    """A config.json path, a checkpoint directory, or the name of a bundled fixture."""
    if Path(name).exists():
        return load_config(name)
    fixture = resources.files("mstar.models.kimi_k3").joinpath("fixtures", name)
    if not fixture.is_file():
        known = sorted(p.name for p in resources.files("mstar.models.kimi_k3").joinpath("fixtures").iterdir())
        raise SystemExit(f"mstar-roofline: {name!r} is neither a path nor a bundled fixture ({', '.join(known)})")
    return parse_config(json.loads(fixture.read_text()))


def latent_sharded(layout: str, config: KimiK3Config) -> bool:
    """--latent-layout as a ShardingPlan flag: "sharded" splits the projections of a latent MoE (a model
    without one, Kimi-Linear, has none to split)."""
    return layout == "sharded" and config.routed_expert_hidden_size is not None


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers, e.g. 1,8,16") from None


def floors(rank: RankModel, args: argparse.Namespace) -> list[Floor]:
    rows = [decode_floor(rank, b, args.context) for b in args.batch]
    rows += [verify_floor(rank, b, k, args.context) for k in args.drafts for b in args.verify_batch]
    rows += [prefill_floor(rank, t, args.prefill_batch) for t in args.prefill]
    return rows


def markdown_table(rows: list[Floor]) -> str:
    lines = ["| step | batch | tokens | weights GB | experts GB | KV GB | KDA state GB | bytes GB | TFLOP "
             "| byte floor µs | FLOP floor µs | floor µs | bound |",
             "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|---|"]
    for f in rows:
        lines.append(f"| {f.step} | {f.batch} | {f.tokens} | {f.weight_bytes / GB:.2f} | {f.expert_bytes / GB:.2f} "
                     f"| {f.kv_bytes / GB:.3f} | {f.kda_bytes / GB:.3f} | {f.bytes / GB:.2f} | {f.flops / TFLOP:.3f} "
                     f"| {f.byte_floor_s / US:,.0f} | {f.flop_floor_s / US:,.0f} | {f.floor_s / US:,.0f} | {f.bound} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="a config.json, a checkpoint directory, or a bundled fixture name "
                                       "(e.g. kimi_k3_pruned75_config.json)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel groups")
    parser.add_argument("--latent-layout", choices=("sharded", "replicated"), default="sharded",
                   help="the latent MoE's down/up projections split over the ranks (faster at every batch measured: "
                        "benchmarks/emulate_rank) or whole on each (sharding.py)")
    parser.add_argument("--rank", type=int, default=0, help="the rank to count (ranks differ only under EP)")
    parser.add_argument("--context", type=int, default=4096, help="tokens cached per request (decode, verify)")
    parser.add_argument("--batch", type=_ints, default=[1, 8, 16, 32, 64], help="decode batch sizes")
    parser.add_argument("--drafts", type=_ints, default=[4, 7], help="draft counts k of the verify rows")
    parser.add_argument("--verify-batch", type=_ints, default=[1, 16], help="batch sizes of the verify rows")
    parser.add_argument("--prefill", type=_ints, default=[1024, 8192], help="prompt lengths of the prefill rows")
    parser.add_argument("--prefill-batch", type=int, default=1, help="requests per prefill step")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    args = parser.parse_args(argv)
    try:
        config = resolve_config(args.config)
        rank = rank_model(config, ShardingPlan(args.tp, args.rank, args.ep, latent_sharded(args.latent_layout, config)))
        rows = floors(rank, args)
    except ValueError as e:
        raise SystemExit(f"mstar-roofline: {e}") from None
    if args.json:
        print(json.dumps({"tp": args.tp, "ep": args.ep, "rank": args.rank, "context": args.context,
                          "hbm_bytes_per_s": HBM_BYTES_PER_S, "bf16_flops_per_s": BF16_FLOPS_PER_S,
                          "rows": [f.as_dict() for f in rows]}, indent=1))
        return
    print(f"{args.config}, rank {args.rank} of tp={args.tp} ep={args.ep}; decode and verify at context {args.context}; "
          f"H200 floors at {HBM_BYTES_PER_S / 1e12:.1f} TB/s and {BF16_FLOPS_PER_S / TFLOP:.0f} TFLOP/s\n")
    print(markdown_table(rows))


if __name__ == "__main__":
    main()
