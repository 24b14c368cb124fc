"""Typed, immutable Kimi K3 (and Kimi-Linear) model configuration parsed from an HF `config.json`.

A real K3 checkpoint has a multimodal top level (`model_type: kimi_k3`) whose `text_config`
(`model_type: kimi_linear`) describes the decoder; Kimi-Linear checkpoints are that text config
alone. Both parse into one `KimiK3Config`; `variant` says which math applies ("kimi_k3": bounded
KDA gate, gated MLA, latent MoE, SiTU, AttnRes; "kimi_linear": softplus gate, plain residuals,
SwiGLU, plain MoE). Errors name the offending key.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A config.json that cannot describe a model mstar runs."""


_TEXT_MODEL_TYPES = ("kimi_linear",)
_TOP_MODEL_TYPES = ("kimi_k3",)


@dataclass(frozen=True)
class LinearAttnConfig:
    """KDA geometry. Layer lists are 0-based here (the checkpoint's are 1-based)."""

    head_dim: int
    num_heads: int
    short_conv_kernel_size: int
    gate_lower_bound: float | None  # K3's bounded gate; None selects Kimi-Linear's softplus gate
    use_full_rank_gate: bool  # output gate: full-rank g_proj (K3) or low-rank g_a/g_b (Kimi-Linear)
    kda_layers: tuple[int, ...]
    full_attn_layers: tuple[int, ...]

    @property
    def width(self) -> int:
        return self.head_dim * self.num_heads


@dataclass(frozen=True)
class QuantizationConfig:
    """compressed-tensors settings. Which tensors are packed is decided per tensor at load time."""

    quant_method: str
    format: str
    group_size: int
    ignore: tuple[str, ...]
    raw: dict[str, Any] = field(compare=False, repr=False)


@dataclass(frozen=True)
class KimiK3Config:
    variant: str  # "kimi_k3" or "kimi_linear"
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    mla_use_output_gate: bool
    intermediate_size: int
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_token: int
    num_shared_experts: int
    routed_expert_hidden_size: int | None  # latent MoE width; None = plain MoE on the hidden state
    latent_moe_use_norm: bool
    first_k_dense_replace: int
    moe_layer_freq: int
    moe_renormalize: bool
    routed_scaling_factor: float
    num_expert_group: int
    topk_group: int
    hidden_act: str  # "situ" or "silu"
    activation_situ_beta: float
    activation_situ_linear_beta: float
    attn_res_block_size: int | None  # None = plain residual stream
    rms_norm_eps: float
    max_position_embeddings: int
    bos_token_id: int
    eos_token_id: int
    pad_token_id: int
    tie_word_embeddings: bool
    linear_attn: LinearAttnConfig
    quantization: QuantizationConfig | None
    weight_prefix: str  # "language_model." under the multimodal wrapper, "" for a bare text model
    torch_dtype: str
    # Not in config.json: set by ShardingPlan.rank_config when the layout shards the latent MoE's
    # projections, the number of ranks that split routed_expert_down_proj's outputs and up_proj's inputs
    # (1: each rank holds both whole).
    latent_shards: int = 1

    # --- derived geometry -------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def mla_softmax_scale(self) -> float:
        # (nope + rope)^-0.5, also in the absorbed 576-wide form.
        return self.qk_head_dim**-0.5

    @property
    def kv_cache_width(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    def is_kda_layer(self, layer: int) -> bool:
        return layer in self.linear_attn.kda_layers

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        return tuple("kda" if self.is_kda_layer(i) else "mla" for i in range(self.num_hidden_layers))

    @property
    def moe_input_size(self) -> int:
        return self.routed_expert_hidden_size or self.hidden_size

    def with_overrides(self, **changes: Any) -> KimiK3Config:
        cfg = replace(self, **changes)
        cfg.validate()
        return cfg

    # --- validation -------------------------------------------------------------------------
    def validate(self) -> None:
        n = self.num_hidden_layers
        la = self.linear_attn
        both = set(la.kda_layers) & set(la.full_attn_layers)
        if both:
            raise ConfigError(
                f"linear_attn_config: layers {sorted(i + 1 for i in both)} (1-based) are in both "
                "kda_layers and full_attn_layers"
            )
        covered = set(la.kda_layers) | set(la.full_attn_layers)
        if covered != set(range(n)):
            missing = sorted(i + 1 for i in set(range(n)) - covered)
            extra = sorted(i + 1 for i in covered - set(range(n)))
            raise ConfigError(
                "linear_attn_config: kda_layers and full_attn_layers must cover layers 1.."
                f"{n} exactly (num_hidden_layers={n}); missing {missing}, out of range {extra}"
            )
        if self.num_experts_per_token > self.num_experts:
            raise ConfigError(
                f"num_experts_per_token={self.num_experts_per_token} exceeds num_experts={self.num_experts}"
            )
        if self.num_expert_group < 1 or self.num_experts % self.num_expert_group:
            raise ConfigError(
                f"num_expert_group={self.num_expert_group} must divide num_experts={self.num_experts}"
            )
        if not 1 <= self.topk_group <= self.num_expert_group:
            raise ConfigError(f"topk_group={self.topk_group} must be in 1..num_expert_group")
        if self.hidden_act not in ("situ", "silu"):
            raise ConfigError(f"hidden_act={self.hidden_act!r} is not supported (expected 'situ' or 'silu')")
        if self.moe_layer_freq < 1:
            raise ConfigError(f"moe_layer_freq={self.moe_layer_freq} must be >= 1")
        if self.attn_res_block_size is not None and self.attn_res_block_size < 1:
            raise ConfigError(f"attn_res_block_size={self.attn_res_block_size} must be >= 1")
        if self.latent_shards < 1 or (self.latent_shards > 1 and (
                self.routed_expert_hidden_size is None or self.routed_expert_hidden_size % self.latent_shards)):
            raise ConfigError(f"latent_shards={self.latent_shards} must be 1, or divide routed_expert_hidden_size="
                              f"{self.routed_expert_hidden_size} (a latent MoE)")
        if self.quantization is not None and self.quantization.format not in (
            "mxfp4-pack-quantized",
            "pack-quantized",
        ):
            raise ConfigError(
                f"quantization_config.format={self.quantization.format!r} is not supported "
                "(expected 'mxfp4-pack-quantized')"
            )


# --- parsing ----------------------------------------------------------------------------------


class _Keys:
    """Reads keys from a dict, remembering where it is so errors name the full key path."""

    def __init__(self, d: dict[str, Any], where: str):
        if not isinstance(d, dict):
            raise ConfigError(f"{where or 'config'} must be a JSON object, got {type(d).__name__}")
        self.d, self.where = d, where

    def _name(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def req(self, key: str, typ: type | tuple[type, ...]) -> Any:
        if key not in self.d:
            raise ConfigError(f"config.json is missing the required key '{self._name(key)}'")
        return self._check(key, self.d[key], typ)

    def opt(self, key: str, typ: type | tuple[type, ...], default: Any) -> Any:
        if key not in self.d or self.d[key] is None:
            return default
        return self._check(key, self.d[key], typ)

    def _check(self, key: str, value: Any, typ: type | tuple[type, ...]) -> Any:
        types = typ if isinstance(typ, tuple) else (typ,)
        if float in types and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if isinstance(value, bool) and bool not in types:
            raise ConfigError(f"'{self._name(key)}' must be {types[0].__name__}, got a boolean")
        if not isinstance(value, types):
            raise ConfigError(
                f"'{self._name(key)}' must be {' or '.join(t.__name__ for t in types)}, "
                f"got {type(value).__name__} ({value!r})"
            )
        return value

    def positive(self, key: str) -> int:
        v = self.req(key, int)
        if v <= 0:
            raise ConfigError(f"'{self._name(key)}' must be positive, got {v}")
        return v


def _layer_list(keys: _Keys, key: str, n: int) -> tuple[int, ...]:
    raw = keys.req(key, list)
    out = []
    for v in raw:
        if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= n:
            raise ConfigError(f"'{keys._name(key)}' holds {v!r}; entries are 1-based layer numbers in 1..{n}")
        out.append(v - 1)
    if len(set(out)) != len(out):
        raise ConfigError(f"'{keys._name(key)}' lists a layer twice")
    return tuple(sorted(out))


def _parse_quantization(raw: Any) -> QuantizationConfig | None:
    if raw is None:
        return None
    k = _Keys(raw, "quantization_config")
    method = k.req("quant_method", str)
    if method != "compressed-tensors":
        raise ConfigError(f"quantization_config.quant_method={method!r} is not supported (compressed-tensors)")
    fmt = k.req("format", str)
    group_size = 32
    groups = k.opt("config_groups", dict, {})
    for name, group in groups.items():
        w = _Keys(_Keys(group, f"quantization_config.config_groups.{name}").req("weights", dict),
                  f"quantization_config.config_groups.{name}.weights")
        bits, gs = w.req("num_bits", int), w.req("group_size", int)
        if bits != 4 or gs != 32:
            raise ConfigError(
                f"quantization_config.config_groups.{name}.weights: MXFP4 needs num_bits=4 and "
                f"group_size=32, got {bits} and {gs}"
            )
    ignore = tuple(k.opt("ignore", list, []))
    return QuantizationConfig(quant_method=method, format=fmt, group_size=group_size, ignore=ignore, raw=raw)


def parse_config(raw: dict[str, Any]) -> KimiK3Config:
    """Parse a config.json dict (K3 multimodal top level or a bare Kimi-Linear text config)."""
    top = _Keys(raw, "")
    model_type = top.req("model_type", str)
    if model_type in _TOP_MODEL_TYPES:
        text = _Keys(top.req("text_config", dict), "text_config")
        text_type = text.req("model_type", str)
        if text_type not in _TEXT_MODEL_TYPES:
            raise ConfigError(f"text_config.model_type={text_type!r} is not supported (expected 'kimi_linear')")
        prefix = "language_model."
        quant_raw = text.d.get("quantization_config", raw.get("quantization_config"))
        variant = "kimi_k3"
    elif model_type in _TEXT_MODEL_TYPES:
        text, prefix, quant_raw = top, "", raw.get("quantization_config")
        # A bare kimi_linear config that carries K3's additions (AttnRes, SiTU, latent MoE) is K3 math.
        variant = "kimi_k3" if "attn_res_block_size" in raw else "kimi_linear"
    else:
        raise ConfigError(
            f"model_type={model_type!r} is not supported; mstar runs 'kimi_k3' (with a kimi_linear "
            "text_config) and 'kimi_linear'"
        )
    k3 = variant == "kimi_k3"
    n = text.positive("num_hidden_layers")
    la = _Keys(text.req("linear_attn_config", dict), f"{text.where + '.' if text.where else ''}linear_attn_config")
    lower = la.opt("gate_lower_bound", float, None)
    if k3 and lower is None:
        raise ConfigError(f"'{la._name('gate_lower_bound')}' is required for Kimi K3 (its bounded KDA gate)")
    linear = LinearAttnConfig(
        head_dim=la.positive("head_dim"),
        num_heads=la.positive("num_heads"),
        short_conv_kernel_size=la.positive("short_conv_kernel_size"),
        gate_lower_bound=lower,
        use_full_rank_gate=la.opt("use_full_rank_gate", bool, False),
        kda_layers=_layer_list(la, "kda_layers", n),
        full_attn_layers=_layer_list(la, "full_attn_layers", n),
    )
    heads = text.positive("num_attention_heads")
    kv_heads = text.opt("num_key_value_heads", int, heads)
    if kv_heads != heads:
        raise ConfigError(f"num_key_value_heads={kv_heads} must equal num_attention_heads={heads} for MLA")
    if not text.opt("mla_use_nope", bool, True):
        raise ConfigError("mla_use_nope=false: mstar's target MLA has no rotary embedding (Kimi MLA is NoPE)")
    topk_method = text.opt("topk_method", str, "noaux_tc")
    if topk_method != "noaux_tc":
        raise ConfigError(f"topk_method={topk_method!r} is not supported (expected 'noaux_tc')")
    router_act = text.opt("moe_router_activation_func", str, "sigmoid")
    if router_act != "sigmoid":
        raise ConfigError(f"moe_router_activation_func={router_act!r} is not supported (expected 'sigmoid')")
    use_grouped = text.opt("use_grouped_topk", bool, True)
    hidden_act = text.req("hidden_act", str)
    if k3 and hidden_act != "situ":
        raise ConfigError(f"hidden_act={hidden_act!r}: Kimi K3 uses 'situ'")
    cfg = KimiK3Config(
        variant=variant,
        vocab_size=text.positive("vocab_size"),
        hidden_size=text.positive("hidden_size"),
        num_hidden_layers=n,
        num_attention_heads=heads,
        q_lora_rank=text.opt("q_lora_rank", int, None),
        kv_lora_rank=text.positive("kv_lora_rank"),
        qk_nope_head_dim=text.positive("qk_nope_head_dim"),
        qk_rope_head_dim=text.positive("qk_rope_head_dim"),
        v_head_dim=text.positive("v_head_dim"),
        mla_use_output_gate=text.req("mla_use_output_gate", bool) if k3 else text.opt(
            "mla_use_output_gate", bool, False),
        intermediate_size=text.positive("intermediate_size"),
        moe_intermediate_size=text.positive("moe_intermediate_size"),
        num_experts=text.positive("num_experts"),
        num_experts_per_token=text.positive("num_experts_per_token"),
        num_shared_experts=text.opt("num_shared_experts", int, 0),
        routed_expert_hidden_size=text.req("routed_expert_hidden_size", int) if k3 else None,
        latent_moe_use_norm=text.req("latent_moe_use_norm", bool) if k3 else False,
        first_k_dense_replace=text.opt("first_k_dense_replace", int, 1),
        moe_layer_freq=text.opt("moe_layer_freq", int, 1),
        moe_renormalize=text.opt("moe_renormalize", bool, True),
        routed_scaling_factor=text.opt("routed_scaling_factor", float, 1.0),
        num_expert_group=text.opt("num_expert_group", int, 1) if use_grouped else 1,
        topk_group=text.opt("topk_group", int, 1) if use_grouped else 1,
        hidden_act=hidden_act,
        activation_situ_beta=text.req("activation_situ_beta", float) if k3 else 0.0,
        activation_situ_linear_beta=text.req("activation_situ_linear_beta", float) if k3 else 0.0,
        attn_res_block_size=text.req("attn_res_block_size", int) if k3 else None,
        rms_norm_eps=text.req("rms_norm_eps", float),
        max_position_embeddings=text.opt("max_position_embeddings", int, 1 << 20),
        bos_token_id=text.opt("bos_token_id", int, top.opt("bos_token_id", int, 163584)),
        eos_token_id=text.opt("eos_token_id", int, top.opt("eos_token_id", int, 163586)),
        pad_token_id=text.opt("pad_token_id", int, top.opt("pad_token_id", int, 163839)),
        tie_word_embeddings=text.opt("tie_word_embeddings", bool, False),
        linear_attn=linear,
        quantization=_parse_quantization(quant_raw),
        weight_prefix=prefix,
        torch_dtype=text.opt("dtype", str, text.opt("torch_dtype", str, "bfloat16")),
    )
    if cfg.num_shared_experts < 0:
        raise ConfigError(f"num_shared_experts={cfg.num_shared_experts} must be >= 0")
    if k3 and cfg.num_hidden_layers - 1 not in linear.full_attn_layers:
        raise ConfigError("linear_attn_config.full_attn_layers: Kimi K3's last layer must be an MLA layer")
    cfg.validate()
    return cfg


def read_config_json(path: str | Path) -> dict[str, Any]:
    """The JSON object in `path` (a config.json, or a checkpoint directory holding one)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        return json.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"no config.json at {p}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{p} is not valid JSON: {e}") from None


def load_config(path: str | Path) -> KimiK3Config:
    """Parse `path` (a config.json, or a checkpoint directory holding one)."""
    return parse_config(read_config_json(path))

