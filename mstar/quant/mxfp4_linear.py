"""`MXFP4Linear`: a bias-free linear layer that keeps its weight in the checkpoint's MXFP4 form.

Routed experts are most of K3's bytes; dequantized to bf16 they take 3.76x their MXFP4 size (a
pruned75 TP8 rank would need ~158 GiB instead of ~64 GiB). So an expert projection whose checkpoint
tensors are MXFP4 holds exactly those bytes, as uint8 buffers named like the checkpoint tensors
(`weight_packed` [out, in/2], `weight_scale` [out, in/32]): `state_dict` is the checkpoint form,
`.to(device)` moves them, and `.to(dtype)` leaves them alone (integer buffers are never cast).

The torch forward dequantizes on the fly in the input's dtype. MXFP4 values are exact in fp32, bf16
and fp64, so it computes exactly what an nn.Linear holding the dequantized weight computes; the
GPU path (`gpu_ops.MXFP4Experts`) reads the buffers directly instead. It stacks a layer's experts with
their codes re-placed for its kernels (mxfp4_words.py) and points each layer's buffers into the stack,
marking it `word_layout`: the layer then decodes that layout, and still saves and loads the checkpoint form.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .mxfp4 import GROUP_SIZE, check_packed_pair, dequantize_mxfp4
from .mxfp4_words import from_word_layout, to_word_layout


class MXFP4Linear(nn.Module):
    """y = x W^T with W [out_features, in_features] stored as MXFP4 (see the module doc)."""

    word_layout = False  # weight_packed holds the expert kernels' word layout (set where they stack it)

    def __init__(self, in_features: int, out_features: int, device: torch.device | str | None = None):
        super().__init__()
        if in_features % GROUP_SIZE:
            raise ValueError(f"MXFP4Linear: in_features={in_features} must be a multiple of the MXFP4 group "
                             f"size {GROUP_SIZE} (one scale byte per {GROUP_SIZE} input columns)")
        self.in_features, self.out_features = in_features, out_features
        u8 = {"dtype": torch.uint8, "device": device}
        self.register_buffer("weight_packed", torch.empty(out_features, in_features // 2, **u8))
        self.register_buffer("weight_scale", torch.empty(out_features, in_features // GROUP_SIZE, **u8))

    @classmethod
    def from_packed(cls, weight_packed: torch.Tensor, weight_scale: torch.Tensor) -> MXFP4Linear:
        """The layer holding these tensors (not copies)."""
        check_packed_pair(weight_packed, weight_scale)
        out_features, half_in = weight_packed.shape
        layer = cls(2 * half_in, out_features, device="meta")
        layer.weight_packed, layer.weight_scale = weight_packed, weight_scale
        return layer

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The dense weight [out, in] in `dtype` (exact for fp32, bf16 and fp64)."""
        return dequantize_mxfp4(self.checkpoint_packed(), self.weight_scale, dtype=dtype)

    def checkpoint_packed(self) -> torch.Tensor:
        """weight_packed as the checkpoint packs it (a converted copy where it holds the word layout)."""
        return from_word_layout(self.weight_packed) if self.word_layout else self.weight_packed

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.word_layout:
            destination[prefix + "weight_packed"] = self.checkpoint_packed()

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        if self.word_layout:  # the checkpoint form was copied into the stack's bytes: re-place it there
            with torch.no_grad():
                self.weight_packed.copy_(to_word_layout(self.weight_packed))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantized(x.dtype))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, MXFP4"


def use_mxfp4_linears(model: nn.Module, weight_names: set[str] | frozenset[str]) -> None:
    """Replace the bias-free nn.Linear owning each `<module>.weight` in `weight_names` with an
    MXFP4Linear of the same shape on the same device (empty: load its buffers next)."""
    for name in sorted(weight_names):
        path = name.removesuffix(".weight")
        linear = model.get_submodule(path)
        if not isinstance(linear, nn.Linear) or linear.bias is not None or not name.endswith(".weight"):
            raise TypeError(f"{name}: only the weight of a bias-free nn.Linear can be held as MXFP4, "
                            f"but {path} is {type(linear).__name__}")
        parent, _, child = path.rpartition(".")
        packed = MXFP4Linear(linear.in_features, linear.out_features, device=linear.weight.device)
        setattr(model.get_submodule(parent), child, packed)
