"""`mstar-make-tiny OUT_DIR`: deterministic random-weight checkpoints in the real HF layouts.

Writes, with no download:
  OUT_DIR/kimi_k3_tiny/          a tiny Kimi K3 (8 layers: KDA and MLA mixed, last layer MLA, AttnRes
                                 blocks of 3, 16 MXFP4 experts top-4, a dense first layer, shared
                                 experts) with a tiny K3 tokenizer (tiktoken BPE learned from the
                                 Python standard library, K3's 256 special slots after the ranks)
  OUT_DIR/kimi_k3_tiny_dspark/   a matching DSpark draft (2 layers, taps on 3 target layers, Markov head)

`--real-dims` instead writes K3's true layer shapes for a chosen number of layers and experts, as
one tensor-parallel rank's shard (`--tp-size`, `--tp-rank`), for GPU benchmarks.

Random init keeps activations well scaled through every layer (linear weights ~ N(0, 1/fan_in),
norms near 1, unit-variance embeddings), so greedy tests compare meaningful, non-degenerate logits.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from mstar.models.dspark.config import parse_dspark_config
from mstar.models.dspark.weights import random_dspark_tensors, save_dspark_checkpoint
from mstar.models.kimi_k3.config import KimiK3Config, parse_config
from mstar.models.kimi_k3.model import KimiK3ForCausalLM
from mstar.models.kimi_k3.weights import (
    checkpoint_dtype,
    expected_checkpoint_shapes,
    is_expert_weight,
    save_checkpoint,
)
from mstar.quant.mxfp4 import random_mxfp4
from mstar.tools.train_bpe import train_tiny_tokenizer

TINY_NUM_RANKS = 1024  # BPE ranks of the tiny tokenizer; its 256 special tokens follow
TINY_SEED = 20261129
# The tiny MLA geometry, shared by the target's MLA layers and the draft's.
TINY_MLA = dict(num_attention_heads=4, num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32,
                qk_rope_head_dim=16, v_head_dim=32)


def k3_fixture(name: str = "kimi_k3_config.json") -> dict[str, Any]:
    text = resources.files("mstar.models.kimi_k3").joinpath("fixtures", name).read_text()
    return json.loads(text)


def special_ids(num_ranks: int) -> dict[str, int]:
    """K3's special tokens sit at fixed offsets after the BPE ranks."""
    return {"bos": num_ranks + 0, "eos": num_ranks + 2, "pad": num_ranks + 255, "media": num_ranks + 21,
            "mask": num_ranks + 253}


def tiny_k3_raw_config(num_ranks: int = TINY_NUM_RANKS) -> dict[str, Any]:
    raw = k3_fixture()
    ids = special_ids(num_ranks)
    raw.update(bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=ids["pad"],
               media_placeholder_token_id=ids["media"])
    raw["text_config"].update(
        vocab_size=num_ranks + 256,
        hidden_size=128,
        num_hidden_layers=8,
        **TINY_MLA,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_experts=16,
        num_experts_per_token=4,
        num_shared_experts=1,
        routed_expert_hidden_size=64,
        attn_res_block_size=3,
        max_position_embeddings=8192,
        bos_token_id=ids["bos"],
        eos_token_id=ids["eos"],
        pad_token_id=ids["pad"],
    )
    raw["text_config"]["linear_attn_config"].update(
        head_dim=32, num_heads=4, full_attn_layers=[4, 7, 8], kda_layers=[1, 2, 3, 5, 6]
    )
    return raw


def tiny_dspark_raw_config(target: KimiK3Config, num_ranks: int = TINY_NUM_RANKS) -> dict[str, Any]:
    ids = special_ids(num_ranks)
    fixture = resources.files("mstar.models.dspark").joinpath("fixtures", "kimi_k3_dspark_config.json")
    raw = json.loads(fixture.read_text())
    taps = [1, 4, 6]
    raw.update(
        hidden_size=target.hidden_size,
        intermediate_size=256,
        num_hidden_layers=2,
        **TINY_MLA,
        vocab_size=target.vocab_size,
        draft_vocab_size=target.vocab_size,
        num_target_layers=len(taps),
        target_hidden_size=target.hidden_size,
        target_num_hidden_layers=target.num_hidden_layers,
        target_layer_ids=taps,
        mask_token_id=ids["mask"],
        bos_token_id=ids["bos"],
        eos_token_id=ids["eos"],
        pad_token_id=ids["pad"],
        markov_rank=32,
    )
    return raw


def real_dims_raw_config(num_layers: int, num_experts: int, tp_size: int, tp_rank: int) -> dict[str, Any]:
    """K3's true per-rank shapes for `num_layers` layers (K3's KDA/MLA pattern, last layer MLA)."""
    raw = k3_fixture()
    text = raw["text_config"]
    for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "moe_intermediate_size",
                "vocab_size"):
        if text[key] % tp_size:
            raise SystemExit(f"--tp-size {tp_size} does not divide text_config.{key}={text[key]}")
        text[key] //= tp_size
    la = text["linear_attn_config"]
    la["num_heads"] //= tp_size
    full = [i for i in range(4, num_layers + 1, 4)]
    if num_layers not in full:
        full.append(num_layers)
    la.update(full_attn_layers=full, kda_layers=[i for i in range(1, num_layers + 1) if i not in full])
    text.update(num_hidden_layers=num_layers, num_experts=num_experts,
                num_experts_per_token=min(text["num_experts_per_token"], num_experts))
    raw["mstar_rank_shard"] = {"tp_size": tp_size, "tp_rank": tp_rank}
    return raw


def _init_tensor(name: str, shape: tuple[int, ...], config: KimiK3Config, gen: torch.Generator) -> torch.Tensor:
    """One random tensor by its role (the name says it), in fp32 before the checkpoint dtype cast."""
    def normal(std: float, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(shape, generator=gen) * std + mean

    if name.endswith("embed_tokens.weight"):
        return normal(1.0)
    if name.endswith(".A_log"):
        heads = config.linear_attn.num_heads
        a_log = torch.zeros(shape).reshape(-1)  # entries past the heads stay zero padding, as in K3
        a_log[:heads] = torch.empty(heads).uniform_(0.5, 1.5, generator=gen).log()
        return a_log.reshape(shape)
    if name.endswith(".dt_bias"):
        return normal(0.5, mean=-3.0)  # decays mostly in (0.5, 1): a memory that spans many tokens
    if "conv1d" in name:
        return normal(0.5)
    if name.endswith("e_score_correction_bias"):
        return normal(0.05)
    if name.endswith(("norm.weight", "layernorm.weight")):
        return normal(0.1, mean=1.0)
    # Every remaining tensor is a linear weight [out, in] (AttnRes pseudo-queries included).
    return normal(1.0 / math.sqrt(shape[-1]))


def random_k3_tensors(config: KimiK3Config, seed: int, *, quantize_experts: bool = True) -> dict[str, torch.Tensor]:
    """Random checkpoint tensors (names, dtypes, MXFP4 experts) for `config`."""
    gen = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        module_names = list(KimiK3ForCausalLM(config).state_dict())
    packed = {n for n in module_names if is_expert_weight(n)} if quantize_experts else set()
    shapes = expected_checkpoint_shapes(config, packed)
    prefix = config.weight_prefix
    out: dict[str, torch.Tensor] = {}
    for name in module_names:
        ck = prefix + name
        if name in packed:
            stem = ck.removesuffix(".weight")
            rows = shapes[f"{stem}.weight_packed"][0]
            cols = shapes[f"{stem}.weight_packed"][1] * 2
            out[f"{stem}.weight_packed"], out[f"{stem}.weight_scale"] = random_mxfp4(rows, cols, gen)
        else:
            out[ck] = _init_tensor(ck, shapes[ck], config, gen).to(checkpoint_dtype(ck))
    return out


def write_tiny(out_dir: Path, *, max_shard_bytes: int | None = 1 << 20) -> tuple[Path, Path]:
    """Write the tiny K3 (sharded, to exercise the index) + tokenizer, and its DSpark draft."""
    target_dir, draft_dir = out_dir / "kimi_k3_tiny", out_dir / "kimi_k3_tiny_dspark"
    raw = tiny_k3_raw_config()
    config = parse_config(raw)
    for d in (target_dir, draft_dir):
        if d.exists():
            shutil.rmtree(d)
    save_checkpoint(target_dir, raw, random_k3_tensors(config, TINY_SEED), max_shard_bytes=max_shard_bytes)
    train_tiny_tokenizer(target_dir, num_ranks=TINY_NUM_RANKS)
    draft_raw = tiny_dspark_raw_config(config)
    draft_cfg = parse_dspark_config(draft_raw)
    gen = torch.Generator().manual_seed(TINY_SEED + 1)
    save_dspark_checkpoint(draft_dir, draft_raw, random_dspark_tensors(draft_cfg, gen))
    return target_dir, draft_dir


def write_real_dims(out_dir: Path, num_layers: int, num_experts: int, tp_size: int, tp_rank: int) -> Path:
    raw = real_dims_raw_config(num_layers, num_experts, tp_size, tp_rank)
    config = parse_config(raw)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tensors = random_k3_tensors(config, TINY_SEED + 1000 * tp_rank)
    save_checkpoint(out_dir, raw, tensors, max_shard_bytes=4 << 30)
    return out_dir


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="mstar-make-tiny", description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir", type=Path)
    p.add_argument("--real-dims", action="store_true", help="write K3's true shapes (one TP rank's shard)")
    p.add_argument("--layers", type=int, default=4, help="with --real-dims: number of decoder layers")
    p.add_argument("--experts", type=int, default=224, help="with --real-dims: routed experts per layer")
    p.add_argument("--tp-size", type=int, default=8, help="with --real-dims: tensor-parallel size")
    p.add_argument("--tp-rank", type=int, default=0, help="with --real-dims: which rank's shard")
    args = p.parse_args(argv)
    if args.real_dims:
        if not 0 <= args.tp_rank < args.tp_size:
            p.error(f"--tp-rank {args.tp_rank} must be in 0..{args.tp_size - 1}")
        path = write_real_dims(args.out_dir, args.layers, args.experts, args.tp_size, args.tp_rank)
        print(f"wrote {path}", file=sys.stderr)
        return
    target, draft = write_tiny(args.out_dir)
    print(f"wrote {target}\nwrote {draft}", file=sys.stderr)


if __name__ == "__main__":
    main()
