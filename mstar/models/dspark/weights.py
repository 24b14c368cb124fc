"""The DSpark draft checkpoint (Inferact/Kimi-K3-DSpark layout): expected tensors, load, save, random init.

Names carry no prefix. The checkpoint holds a copy of the frozen target embedding
(`embed_tokens.weight`); the draft borrows the target's instead, so loading skips it without reading
it. There is no lm_head (the target's is used after the draft's `final_norm`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from mstar.checkpoint.safetensors_io import (
    CheckpointError,
    CheckpointReader,
    check_tensor_names_and_shapes,
    write_checkpoint,
)
from mstar.models.dspark.config import DSparkConfig, load_dspark_config, parse_dspark_config

EMBED_TOKENS = "embed_tokens.weight"  # present in the checkpoint, never loaded

_TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

Shape = tuple[int, ...]


def expected_dspark_tensors(cfg: DSparkConfig) -> dict[str, tuple[Shape, torch.dtype]]:
    """Every tensor of a DSpark draft checkpoint, name -> (shape, stored dtype), including embed_tokens."""
    d, v, r = cfg.hidden_size, cfg.vocab_size, cfg.markov_rank
    shapes: dict[str, Shape] = {
        EMBED_TOKENS: (v, d),
        "context_proj.weight": (d, cfg.context_input_size),
        "context_norm.weight": (d,),
        "final_norm.weight": (d,),
        "markov_head.markov_w1.weight": (cfg.draft_vocab_size, r),
        "markov_head.markov_w2.weight": (cfg.draft_vocab_size, r),
    }
    if cfg.enable_confidence_head:
        shapes["confidence_head.proj.weight"] = (1, cfg.confidence_input_size)
        shapes["confidence_head.proj.bias"] = (1,)
    for i in range(cfg.num_hidden_layers):
        shapes.update({f"layers.{i}.{name}": shape for name, shape in _layer_shapes(cfg).items()})
    dtype = _TORCH_DTYPES[cfg.torch_dtype]
    return {name: (shape, dtype) for name, shape in shapes.items()}


def _layer_shapes(cfg: DSparkConfig) -> dict[str, Shape]:
    d, h = cfg.hidden_size, cfg.num_attention_heads
    shapes: dict[str, Shape] = {
        "input_layernorm.weight": (d,),
        "post_attention_layernorm.weight": (d,),
    }
    if cfg.q_lora_rank is None:
        shapes["self_attn.q_proj.weight"] = (h * cfg.qk_head_dim, d)
    else:
        shapes["self_attn.q_a_proj.weight"] = (cfg.q_lora_rank, d)
        shapes["self_attn.q_a_layernorm.weight"] = (cfg.q_lora_rank,)
        shapes["self_attn.q_b_proj.weight"] = (h * cfg.qk_head_dim, cfg.q_lora_rank)
    shapes.update({
        "self_attn.kv_a_proj_with_mqa.weight": (cfg.kv_cache_width, d),
        "self_attn.kv_a_layernorm.weight": (cfg.kv_lora_rank,),
        "self_attn.kv_b_proj.weight": (h * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
        "self_attn.o_proj.weight": (d, h * cfg.v_head_dim),
        "mlp.gate_proj.weight": (cfg.intermediate_size, d),
        "mlp.up_proj.weight": (cfg.intermediate_size, d),
        "mlp.down_proj.weight": (d, cfg.intermediate_size),
    })
    return shapes


def _check_layout(cfg: DSparkConfig, found: Mapping[str, Shape], what: str) -> None:
    """Names and shapes must match exactly, except that embed_tokens may be absent."""
    expected = {name: shape for name, (shape, _) in expected_dspark_tensors(cfg).items()}
    if EMBED_TOKENS not in found:
        del expected[EMBED_TOKENS]
    check_tensor_names_and_shapes(found, expected, what=what)


def load_dspark_checkpoint(
    path: str | Path, dtype: torch.dtype = torch.float32
) -> tuple[DSparkConfig, dict[str, torch.Tensor]]:
    """Load a draft checkpoint directory (config.json + safetensors) as `dtype` tensors.

    Validates every name and shape before reading any data; `embed_tokens.weight` is checked by
    shape (from the header) but not read, and is not in the returned dict.
    """
    path = Path(path)
    cfg = load_dspark_config(path)
    with CheckpointReader(path) as reader:
        found = {name: reader.shape(name) for name in reader.names()}
        _check_layout(cfg, found, what=f"DSpark draft checkpoint {path}")
        tensors: dict[str, torch.Tensor] = {}
        for name in sorted(found):
            if name == EMBED_TOKENS:
                continue
            stored = reader.dtype(name)
            if not stored.is_floating_point:
                raise CheckpointError(
                    f"DSpark draft checkpoint {path}: tensor '{name}' is stored as {stored}; the draft's weights "
                    "are unquantized floating point"
                )
            tensors[name] = reader.get(name).to(dtype)
    return cfg, tensors


def save_dspark_checkpoint(
    out_dir: str | Path,
    raw_config: dict[str, Any],
    tensors: Mapping[str, torch.Tensor],
    max_shard_bytes: int | None = None,
) -> DSparkConfig:
    """Validate `raw_config` and `tensors` against each other, then write config.json + safetensors."""
    cfg = parse_dspark_config(raw_config)
    _check_layout(cfg, {n: tuple(t.shape) for n, t in tensors.items()}, what="DSpark draft tensors to save")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_checkpoint(out, tensors, max_shard_bytes=max_shard_bytes)
    (out / "config.json").write_text(json.dumps(raw_config, indent=2) + "\n")
    return cfg


def random_dspark_tensors(
    cfg: DSparkConfig,
    generator: torch.Generator,
    dtype: torch.dtype = torch.bfloat16,
    *,
    include_embed_tokens: bool = True,
) -> dict[str, torch.Tensor]:
    """Well-scaled random weights for tiny test checkpoints.

    Linear weights ~ N(0, 1/fan_in) (unit-variance outputs for unit-variance inputs), norms 1,
    confidence bias 0. Markov W1/W2 entries have variance 0.5/sqrt(r), so each entry of the bias
    W1[x] @ W2^T (a sum of r products) has std 0.5: a visible but not dominant correction to unit-scale logits.
    """
    out: dict[str, torch.Tensor] = {}
    markov_std = math.sqrt(0.5 / math.sqrt(cfg.markov_rank))
    for name, (shape, _) in expected_dspark_tensors(cfg).items():
        if name == EMBED_TOKENS and not include_embed_tokens:
            continue
        if name.endswith("norm.weight"):
            t = torch.ones(shape)
        elif name == "confidence_head.proj.bias":
            t = torch.zeros(shape)
        elif name.startswith("markov_head."):
            t = torch.randn(shape, generator=generator) * markov_std
        elif name == EMBED_TOKENS:
            t = torch.randn(shape, generator=generator)
        else:
            t = torch.randn(shape, generator=generator) * shape[1] ** -0.5
        out[name] = t.to(dtype)
    return out
