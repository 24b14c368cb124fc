"""Kimi K3 checkpoint <-> reference model: tensor names, dtypes, MXFP4 experts, strict checks.

Checkpoint names are the module names under `config.weight_prefix` (`language_model.` for K3's
multimodal wrapper). Three tensors differ in form between checkpoint and module:

- routed-expert weights `...experts.E.wN.weight` may be stored as compressed-tensors MXFP4
  (`weight_packed` u8 [out, in/2] + `weight_scale` u8 [out, in/32]); this is decided per tensor by
  what the checkpoint holds, never by name or config. Such a projection is loaded as an
  `MXFP4Linear` holding those two tensors as they are (its state_dict names are the checkpoint's),
  never as a dense weight: dense experts would take 3.76x the bytes. Saving writes them back as
  they are, bit for bit;
- `A_log` is zero-padded in K3 checkpoints ([128] for 96 heads) and [1, 1, H, 1] in Kimi-Linear;
  the module keeps [H];
- vision-tower and projector tensors are skipped.
Everything else must match by name and shape; a missing, extra or mis-shaped tensor is an error
that names it.
"""

from __future__ import annotations

import json
import sys
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
from mstar.quant.mxfp4 import GROUP_SIZE, quantize_mxfp4
from mstar.quant.mxfp4_linear import use_mxfp4_linears

from .config import KimiK3Config, load_config, parse_config
from .model import KimiK3ForCausalLM

# Tensors the real checkpoint stores in fp32 (reference/kimi_k3.md §7); the rest is bf16 or u8.
_FP32_SUFFIXES = (
    ".A_log",
    ".dt_bias",
    ".q_conv1d.weight",
    ".k_conv1d.weight",
    ".v_conv1d.weight",
    ".o_norm.weight",
    ".e_score_correction_bias",
)
_SKIPPED_PREFIXES = ("vision_tower.", "mm_projector.", "language_model.vision_tower.")
A_LOG_PAD = 128  # K3 stores A_log zero-padded to a multiple of 128 entries


def is_expert_weight(name: str) -> bool:
    parts = name.split(".")
    return len(parts) >= 4 and parts[-4] == "experts" and parts[-2] in ("w1", "w2", "w3") and parts[-1] == "weight"


def checkpoint_dtype(name: str) -> torch.dtype:
    return torch.float32 if name.endswith(_FP32_SUFFIXES) else torch.bfloat16


def packed_names(name: str) -> tuple[str, str]:
    stem = name.removesuffix(".weight")
    return f"{stem}.weight_packed", f"{stem}.weight_scale"


def packed_shapes(shape: tuple[int, ...]) -> tuple[tuple[int, int], tuple[int, int]]:
    """Shapes of (weight_packed, weight_scale) for a dense weight of `shape` [out, in]."""
    out, inputs = shape
    return (out, inputs // 2), (out, inputs // GROUP_SIZE)


def _a_log_shape(config: KimiK3Config) -> tuple[int, ...]:
    h = config.linear_attn.num_heads
    if config.variant == "kimi_linear":
        return (1, 1, h, 1)
    return (-(-h // A_LOG_PAD) * A_LOG_PAD,)


def expected_checkpoint_shapes(config: KimiK3Config, packed: set[str] = frozenset()) -> dict[str, tuple[int, ...]]:
    """Checkpoint name -> shape; expert weights named in `packed` (module names) are MXFP4 pairs."""
    with torch.device("meta"):
        model = KimiK3ForCausalLM(config)
    shapes: dict[str, tuple[int, ...]] = {}
    for name, param in model.state_dict().items():
        ck = config.weight_prefix + name
        if name in packed:
            shapes.update(zip(packed_names(ck), packed_shapes(tuple(param.shape)), strict=True))
        elif name.endswith(".A_log"):
            shapes[ck] = _a_log_shape(config)
        else:
            shapes[ck] = tuple(param.shape)
    return shapes


def read_a_log(reader: CheckpointReader, ck_name: str, heads: int) -> torch.Tensor:
    raw = reader.get(ck_name).reshape(-1)
    if raw.numel() < heads:
        raise CheckpointError(f"{ck_name}: has {raw.numel()} entries, fewer than the {heads} KDA heads")
    if raw.numel() > heads and bool((raw[heads:] != 0).any()):
        raise CheckpointError(f"{ck_name}: entries past the first {heads} (one per head) must be zero padding")
    return raw[:heads]


def _skipped(name: str) -> bool:
    return name.startswith(_SKIPPED_PREFIXES)


def check_checkpoint_layout(reader: CheckpointReader, config: KimiK3Config, module_names: list[str], *,
                            what: str) -> set[str]:
    """Check every tensor name and shape of the checkpoint against the whole model of `config`
    (headers only); return the module names of the expert weights stored as MXFP4."""
    prefix = config.weight_prefix
    packed = {n for n in module_names if is_expert_weight(n) and reader.has(packed_names(prefix + n)[0])}
    found = {n: tuple(reader.shape(n)) for n in reader.names() if not _skipped(n)}
    check_tensor_names_and_shapes(found, expected_checkpoint_shapes(config, packed), what=what)
    return packed


def load_model(
    checkpoint_dir: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    progress: bool | None = None,
) -> KimiK3ForCausalLM:
    """Build the reference model from an HF checkpoint directory (config.json + safetensors)."""
    config = load_config(checkpoint_dir)
    with torch.device("meta"):
        model = KimiK3ForCausalLM(config)
    module_names = list(model.state_dict())
    with CheckpointReader(checkpoint_dir) as reader:
        prefix = config.weight_prefix
        packed = check_checkpoint_layout(reader, config, module_names, what=str(checkpoint_dir))
        tensors = {}
        for name in _progress(module_names, progress, f"loading {Path(checkpoint_dir).name}"):
            ck = prefix + name
            if name in packed:
                for ck_packed, module_packed in zip(packed_names(ck), packed_names(name), strict=True):
                    tensors[module_packed] = reader.get(ck_packed)
            elif name.endswith(".A_log"):
                tensors[name] = read_a_log(reader, ck, config.linear_attn.num_heads)
            else:
                tensors[name] = reader.get(ck)
    return assign_weights(model, tensors, dtype=dtype, device=device)


def assign_weights(model: KimiK3ForCausalLM, tensors: Mapping[str, torch.Tensor], *, dtype: torch.dtype,
                   device: str | torch.device) -> KimiK3ForCausalLM:
    """Load `tensors` ({module name: tensor}, expert projections as `weight_packed`/`weight_scale` pairs
    where the checkpoint holds them so) into `model` built on the meta device: those projections
    become `MXFP4Linear`s keeping the uint8 tensors; every float tensor is cast to `dtype`."""
    use_mxfp4_linears(model, {n.removesuffix("_packed") for n in tensors if n.endswith(".weight_packed")})
    cast = {n: t.to(device=device, dtype=t.dtype if t.dtype == torch.uint8 else dtype) for n, t in tensors.items()}
    model.load_state_dict(cast, strict=True, assign=True)
    return model.eval()


def checkpoint_tensors(model: KimiK3ForCausalLM, *, quantize_experts: bool) -> dict[str, torch.Tensor]:
    """The model's weights in checkpoint names, dtypes and forms. Experts held as MXFP4 are written
    as they are (uint8, bit for bit); dense experts are quantized to MXFP4 when asked."""
    config = model.config
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        ck = config.weight_prefix + name
        t = t.detach().cpu()
        if t.dtype == torch.uint8:
            # clone: held experts' buffers may be views into their layer's stacked kernel weights
            # (gpu_ops.MXFP4Experts), and safetensors refuses tensors that share storage.
            out[ck] = t.clone()
        elif quantize_experts and is_expert_weight(name):
            w_packed, w_scale = packed_names(ck)
            out[w_packed], out[w_scale] = quantize_mxfp4(t.float())
        elif name.endswith(".A_log"):
            padded = torch.zeros(_a_log_shape(config)).reshape(-1)
            padded[: t.numel()] = t
            out[ck] = padded.reshape(_a_log_shape(config)).to(checkpoint_dtype(ck))
        else:
            out[ck] = t.to(checkpoint_dtype(ck))
    return out


def save_checkpoint(
    out_dir: str | Path,
    raw_config: Mapping[str, Any],
    tensors: Mapping[str, torch.Tensor],
    *,
    max_shard_bytes: int | None = None,
) -> KimiK3Config:
    """Write config.json and the tensors (already in checkpoint form) as an HF checkpoint."""
    config = parse_config(dict(raw_config))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    packed = {n.removeprefix(config.weight_prefix).removesuffix("_packed")
              for n in tensors if n.endswith(".weight_packed")}
    found = {n: tuple(t.shape) for n, t in tensors.items()}
    check_tensor_names_and_shapes(found, expected_checkpoint_shapes(config, packed), what="tensors to save")
    write_checkpoint(out, tensors, max_shard_bytes=max_shard_bytes, metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(raw_config, indent=2) + "\n")
    return config


def _progress(items: list[str], enabled: bool | None, desc: str):
    if enabled is None:
        enabled = sys.stderr.isatty() and len(items) > 200
    if not enabled:
        return items
    from tqdm import tqdm

    return tqdm(items, desc=desc, unit="tensor")
