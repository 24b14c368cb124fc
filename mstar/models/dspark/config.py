"""Typed, immutable DSpark draft configuration parsed from the draft's HF `config.json`.

The draft (Inferact/Kimi-K3-DSpark, `model_type: k3_dspark`) is a small DeepSeek-V3-style stack:
RoPE (yarn) MLA + SwiGLU layers that read a projection of hidden states tapped from several target
layers, plus a low-rank Markov head (and a confidence head). It borrows the target's embedding
and lm_head, so its geometry must match the target's (`check_matches_target`). Errors name the key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mstar.models.kimi_k3.config import ConfigError, _Keys, read_config_json

MODEL_TYPE = "k3_dspark"
ARCHITECTURE = "K3DSparkModel"
FIXTURE_PATH = Path(__file__).parent / "fixtures" / "kimi_k3_dspark_config.json"


@dataclass(frozen=True)
class YarnRopeConfig:
    """DeepSeek-style yarn RoPE (`rope_parameters`, rope_type "yarn")."""

    factor: float
    original_max_position_embeddings: int
    rope_theta: float
    beta_fast: float
    beta_slow: float
    mscale: float
    mscale_all_dim: float

    @staticmethod
    def get_mscale(factor: float, mscale: float) -> float:
        # DeepSeek-V3 yarn attention-magnitude correction, as in DeepSeek's HF modeling code
        # (`yarn_get_mscale(scale, mscale)` in modeling_deepseek.py, also transformers'
        # deepseek_v3) and deepseek-ai/DeepSeek-V3 inference/model.py `MLA.__init__`:
        # 1 for factor <= 1, else 0.1 * mscale * ln(factor) + 1.
        return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0

    @property
    def attention_mscale(self) -> float:
        """m applied (squared) to the softmax scale: yarn_get_mscale(factor, mscale_all_dim)."""
        return self.get_mscale(self.factor, self.mscale_all_dim)

    @property
    def cos_sin_mscale(self) -> float:
        """The magnitude factor yarn folds into cos/sin: mscale(factor, mscale) / mscale(factor, mscale_all_dim).

        1.0 when mscale == mscale_all_dim, as in the K3 draft.
        """
        return self.get_mscale(self.factor, self.mscale) / self.get_mscale(self.factor, self.mscale_all_dim)


@dataclass(frozen=True)
class DSparkConfig:
    architectures: tuple[str, ...]
    model_type: str
    # backbone
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    hidden_act: str  # absent in the real config: DeepseekV2Config's default "silu" (SwiGLU MLP)
    # MLA geometry (DeepSeek-V3 style: RoPE on a 64-wide slice, no output gate)
    q_lora_rank: int | None  # None: a plain q_proj instead of q_a_proj/q_a_layernorm/q_b_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # vocab, norms, positions
    vocab_size: int
    draft_vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    rope: YarnRopeConfig
    # target taps
    num_target_layers: int
    target_hidden_size: int
    target_num_hidden_layers: int
    target_layer_ids: tuple[int, ...]  # 0-based target layers whose raw prefix-sum stream is tapped, in concat order
    # special tokens
    mask_token_id: int
    bos_token_id: int
    eos_token_id: int
    pad_token_id: int
    # DSpark heads
    markov_rank: int
    markov_head_type: str
    enable_confidence_head: bool
    confidence_head_with_markov: bool
    tie_word_embeddings: bool
    torch_dtype: str

    # --- derived geometry -------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def yarn_mscale(self) -> float:
        return self.rope.attention_mscale

    @property
    def softmax_scale(self) -> float:
        # (nope + rope)^-0.5 * m^2 with m = 0.1 * mscale_all_dim * ln(factor) + 1 (see YarnRopeConfig.get_mscale).
        # For the K3 draft: 192^-0.5 * 1.3466^2 ≈ 0.1309.
        return self.qk_head_dim**-0.5 * self.yarn_mscale**2

    @property
    def kv_cache_width(self) -> int:
        """Latent cache row per token and layer: normed kv latent + roped k_pe."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def context_input_size(self) -> int:
        """Width of the concatenated target taps that context_proj reads."""
        return self.num_target_layers * self.target_hidden_size

    @property
    def confidence_input_size(self) -> int:
        return self.hidden_size + (self.markov_rank if self.confidence_head_with_markov else 0)

    # --- checks -----------------------------------------------------------------------------
    def check_matches_target(self, target_hidden_size: int, target_num_layers: int, vocab_size: int) -> None:
        """Raise ConfigError unless this draft was built for a target of this geometry."""
        if target_hidden_size != self.target_hidden_size:
            raise ConfigError(
                f"draft config target_hidden_size={self.target_hidden_size} but the target's hidden_size is "
                f"{target_hidden_size}; this draft was trained for another target"
            )
        if target_num_layers != self.target_num_hidden_layers:
            raise ConfigError(
                f"draft config target_num_hidden_layers={self.target_num_hidden_layers} but the target has "
                f"{target_num_layers} layers; the tapped layers {list(self.target_layer_ids)} would be wrong"
            )
        if vocab_size != self.vocab_size:
            raise ConfigError(
                f"draft config vocab_size={self.vocab_size} but the target's vocab_size is {vocab_size}; the draft "
                "borrows the target's embedding and lm_head, so they must agree"
            )

    def validate(self) -> None:
        if self.num_key_value_heads != self.num_attention_heads:
            raise ConfigError(
                f"num_key_value_heads={self.num_key_value_heads} must equal num_attention_heads="
                f"{self.num_attention_heads} (MLA has one latent shared by all heads)"
            )
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even (RoPE rotates pairs)")
        if len(self.target_layer_ids) != self.num_target_layers:
            raise ConfigError(
                f"target_layer_ids has {len(self.target_layer_ids)} entries but num_target_layers="
                f"{self.num_target_layers}"
            )
        last = self.target_num_hidden_layers - 1
        for layer in self.target_layer_ids:
            if not 0 <= layer < last:
                raise ConfigError(
                    f"target_layer_ids holds {layer}; entries are 0-based target layers in 0..{last - 1} "
                    f"(target_num_hidden_layers={self.target_num_hidden_layers}; the last layer {last} is never "
                    "tapped)"
                )
        if len(set(self.target_layer_ids)) != len(self.target_layer_ids):
            raise ConfigError(f"target_layer_ids={list(self.target_layer_ids)} lists a layer twice")
        if self.hidden_size != self.target_hidden_size:
            raise ConfigError(
                f"hidden_size={self.hidden_size} must equal target_hidden_size={self.target_hidden_size}: the draft "
                "embeds its block with the target's embedding and reads logits through the target's lm_head"
            )
        if self.draft_vocab_size != self.vocab_size:
            raise ConfigError(
                f"draft_vocab_size={self.draft_vocab_size} differs from vocab_size={self.vocab_size}; a reduced "
                "draft vocabulary (with a token map) is not supported"
            )
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ConfigError(f"mask_token_id={self.mask_token_id} is outside the vocabulary 0..{self.vocab_size - 1}")
        if self.markov_head_type != "vanilla":
            raise ConfigError(
                f"markov_head_type={self.markov_head_type!r} is not supported (expected 'vanilla': the low-rank "
                "bias W1[x_prev] @ W2^T)"
            )
        if self.hidden_act != "silu":
            raise ConfigError(
                f"hidden_act={self.hidden_act!r} is not supported (the DSpark draft MLP is SwiGLU: 'silu')"
            )
        if self.torch_dtype not in ("bfloat16", "float16", "float32"):
            raise ConfigError(f"torch_dtype={self.torch_dtype!r} is not supported (bfloat16, float16 or float32)")
        if self.tie_word_embeddings:
            raise ConfigError("tie_word_embeddings=true: the DSpark draft has no lm_head of its own to tie")


# --- parsing ----------------------------------------------------------------------------------


def _non_negative(keys: _Keys, key: str, default: int | None = None) -> int:
    v = keys.req(key, int) if default is None else keys.opt(key, int, default)
    if v < 0:
        raise ConfigError(f"'{keys._name(key)}' must be >= 0, got {v}")
    return v


def _positive_float(keys: _Keys, key: str, default: float | None = None) -> float:
    v = keys.req(key, float) if default is None else keys.opt(key, float, default)
    if not v > 0:
        raise ConfigError(f"'{keys._name(key)}' must be > 0, got {v}")
    return v


def _parse_rope(top: _Keys) -> YarnRopeConfig:
    # Newer transformers write `rope_parameters`; older configs `rope_scaling` (same content).
    key = "rope_parameters" if "rope_parameters" in top.d else "rope_scaling"
    if key not in top.d:
        raise ConfigError("config.json is missing the required key 'rope_parameters' (yarn RoPE settings)")
    rp = _Keys(top.req(key, dict), key)
    rope_type = rp.opt("rope_type", str, rp.opt("type", str, None))
    if rope_type != "yarn":
        raise ConfigError(f"'{key}.rope_type'={rope_type!r} is not supported (the DSpark draft uses 'yarn')")
    top_theta = top.opt("rope_theta", float, None)
    theta = rp.opt("rope_theta", float, top_theta)
    if theta is None:
        raise ConfigError(f"config.json is missing the required key 'rope_theta' (or '{key}.rope_theta')")
    if top_theta is not None and top_theta != theta:
        raise ConfigError(f"rope_theta={top_theta} disagrees with {key}.rope_theta={theta}")
    factor = _positive_float(rp, "factor")
    return YarnRopeConfig(
        factor=factor,
        original_max_position_embeddings=rp.positive("original_max_position_embeddings"),
        rope_theta=theta,
        beta_fast=rp.opt("beta_fast", float, 32.0),
        beta_slow=rp.opt("beta_slow", float, 1.0),
        mscale=rp.opt("mscale", float, 1.0),
        mscale_all_dim=rp.opt("mscale_all_dim", float, 0.0),
    )


def _layer_ids(keys: _Keys, key: str) -> tuple[int, ...]:
    raw = keys.req(key, list)
    for v in raw:
        if not isinstance(v, int) or isinstance(v, bool):
            raise ConfigError(f"'{key}' holds {v!r}; entries are 0-based target layer indices (int)")
    return tuple(raw)


def parse_dspark_config(raw: dict[str, Any]) -> DSparkConfig:
    """Parse a DSpark draft config.json dict."""
    top = _Keys(raw, "")
    model_type = top.req("model_type", str)
    if model_type != MODEL_TYPE:
        raise ConfigError(f"model_type={model_type!r} is not a DSpark draft for Kimi K3 (expected '{MODEL_TYPE}')")
    architectures = tuple(top.opt("architectures", list, [ARCHITECTURE]))
    if ARCHITECTURE not in architectures:
        raise ConfigError(f"architectures={list(architectures)} does not name '{ARCHITECTURE}'")
    if top.opt("mla_use_nope", bool, False):
        raise ConfigError("mla_use_nope=true: the DSpark draft's MLA applies RoPE (DeepSeek-V3 style); NoPE drafts "
                          "are not supported")
    if top.opt("mla_use_output_gate", bool, False):
        raise ConfigError("mla_use_output_gate=true: the DSpark draft's MLA has no output gate")
    heads = top.positive("num_attention_heads")
    q_lora = top.opt("q_lora_rank", int, None)
    if q_lora is not None and q_lora <= 0:
        raise ConfigError(f"'q_lora_rank' must be positive or null, got {q_lora}")
    vocab = top.positive("vocab_size")
    rope = _parse_rope(top)
    cfg = DSparkConfig(
        architectures=architectures,
        model_type=model_type,
        hidden_size=top.positive("hidden_size"),
        intermediate_size=top.positive("intermediate_size"),
        num_hidden_layers=top.positive("num_hidden_layers"),
        num_attention_heads=heads,
        num_key_value_heads=top.opt("num_key_value_heads", int, heads),
        hidden_act=top.opt("hidden_act", str, "silu"),
        q_lora_rank=q_lora,
        kv_lora_rank=top.positive("kv_lora_rank"),
        qk_nope_head_dim=top.positive("qk_nope_head_dim"),
        qk_rope_head_dim=top.positive("qk_rope_head_dim"),
        v_head_dim=top.positive("v_head_dim"),
        vocab_size=vocab,
        draft_vocab_size=top.opt("draft_vocab_size", int, vocab),
        rms_norm_eps=_positive_float(top, "rms_norm_eps"),
        max_position_embeddings=top.opt(
            "max_position_embeddings", int, int(rope.original_max_position_embeddings * rope.factor)),
        rope_theta=rope.rope_theta,
        rope=rope,
        num_target_layers=top.positive("num_target_layers"),
        target_hidden_size=top.positive("target_hidden_size"),
        target_num_hidden_layers=top.positive("target_num_hidden_layers"),
        target_layer_ids=_layer_ids(top, "target_layer_ids"),
        mask_token_id=_non_negative(top, "mask_token_id"),
        bos_token_id=_non_negative(top, "bos_token_id", 163584),
        eos_token_id=_non_negative(top, "eos_token_id", 163586),
        pad_token_id=_non_negative(top, "pad_token_id", 163839),
        markov_rank=top.positive("markov_rank"),
        markov_head_type=top.opt("markov_head_type", str, "vanilla"),
        enable_confidence_head=top.opt("enable_confidence_head", bool, False),
        confidence_head_with_markov=top.opt("confidence_head_with_markov", bool, True),
        tie_word_embeddings=top.opt("tie_word_embeddings", bool, False),
        torch_dtype=top.opt("torch_dtype", str, top.opt("dtype", str, "bfloat16")),
    )
    cfg.validate()
    return cfg


def load_dspark_config(path: str | Path) -> DSparkConfig:
    """Parse `path` (a config.json, or a draft checkpoint directory holding one)."""
    return parse_dspark_config(read_config_json(path))
