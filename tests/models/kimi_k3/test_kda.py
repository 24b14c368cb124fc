"""KDA (mstar/models/kimi_k3/kda.py) against float64 references written here from the formulas, and against
fla's pure-torch reference code (`fla/ops/kda/naive.py`, the naive gates of `fla/ops/kda/gate.py`).

Every test draws fresh random inputs (the seed is printed, so a failure can be replayed). Run with `-s` to
see the largest error of each comparison kind at the end of the module.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import math
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from mstar.models.kimi_k3 import kda as kda_mod
from mstar.models.kimi_k3.config import ConfigError, parse_config
from mstar.models.kimi_k3.kda import (
    KDAState,
    KimiDeltaAttention,
    kda_chunked,
    kda_gate,
    kda_recurrent,
    l2_normalize,
    short_conv,
)

FIXTURE = Path(kda_mod.__file__).parent / "fixtures" / "kimi_k3_config.json"
F64 = torch.float64

# --- bookkeeping ------------------------------------------------------------------------------------

LARGEST_ERRORS: dict[str, float] = {}


@pytest.fixture(autouse=True)
def fresh_seed():
    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    print(f"torch seed {seed}")
    yield


@pytest.fixture(scope="module", autouse=True)
def report_largest_errors():
    yield
    print("\nlargest |error| per comparison:")
    for what, err in sorted(LARGEST_ERRORS.items()):
        print(f"  {what:55s} {err:.3e}")


def check(what: str, actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float = 0.0) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a, e = actual.detach().double(), expected.detach().double()
    err = (a - e).abs().max().item() if a.numel() else 0.0
    LARGEST_ERRORS[what] = max(LARGEST_ERRORS.get(what, 0.0), err)
    torch.testing.assert_close(a, e, atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


# --- tiny configs ---------------------------------------------------------------------------------------


def tiny_config(*, k3: bool = True, lower_bound: float | None = -5.0, full_rank_gate: bool = True,
                num_heads: int = 3, head_dim: int = 16, conv_kernel: int = 4):
    """The real K3 config.json shrunk to hidden 64 and 4 layers (KDA, KDA, KDA, MLA).

    k3=False gives a bare Kimi-Linear text config (variant "kimi_linear"); only that one may drop the
    gate lower bound, and it can also carry K3's bounded gate or full-rank output gate, so all four gate
    combinations can be built.
    """
    raw = json.loads(FIXTURE.read_text())
    text = raw["text_config"]
    text.update(hidden_size=64, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2, vocab_size=256,
                q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                intermediate_size=96, moe_intermediate_size=16, num_experts=4, num_experts_per_token=2,
                routed_expert_hidden_size=32)
    la = text["linear_attn_config"]
    la.update(head_dim=head_dim, num_heads=num_heads, short_conv_kernel_size=conv_kernel,
              use_full_rank_gate=full_rank_gate, kda_layers=[1, 2, 3], full_attn_layers=[4])
    if lower_bound is None:
        la.pop("gate_lower_bound")
    else:
        la["gate_lower_bound"] = lower_bound
    if k3:
        return parse_config(raw)
    for key in ("attn_res_block_size", "routed_expert_hidden_size", "latent_moe_use_norm"):
        text.pop(key)
    text["hidden_act"] = "silu"
    return parse_config(text)


VARIANTS = {
    "k3": dict(k3=True, lower_bound=-5.0, full_rank_gate=True),
    "kimi_linear": dict(k3=False, lower_bound=None, full_rank_gate=False),
    "bounded+lowrank": dict(k3=False, lower_bound=-5.0, full_rank_gate=False),
    "softplus+fullrank": dict(k3=False, lower_bound=None, full_rank_gate=True),
}


def make_layer(variant: str = "k3", dtype: torch.dtype = F64, **overrides) -> KimiDeltaAttention:
    cfg = tiny_config(**{**VARIANTS[variant], **overrides})
    layer = KimiDeltaAttention(cfg, layer_idx=1).to(dtype)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name == "A_log":
                p.copy_(0.5 * torch.randn_like(p))
            elif name == "dt_bias":  # centred below 0 so the gates spread from mild to strong decay
                p.copy_(torch.randn_like(p) - 1.5)
            elif name == "o_norm.weight":
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("conv1d.weight"):
                p.copy_(0.5 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / math.sqrt(p.shape[1]))
    return layer


def random_state(layer: KimiDeltaAttention, dtype: torch.dtype = F64) -> KDAState:
    H, K, W = layer.num_heads, layer.head_dim, layer.conv_kernel
    return KDAState(recurrent=0.3 * torch.randn(H, K, K, dtype=torch.promote_types(dtype, torch.float32)),
                    conv=torch.randn(3, W - 1, H * K, dtype=dtype))


# --- float64 references, straight from the formulas (they never call kda.py) -----------------------------


def ref_sigmoid(z):
    return 1 / (1 + torch.exp(-z))


def ref_short_conv(x, w, window=None):
    """y_t[c] = SiLU(sum_j w[c,0,j] x_{t-W+1+j}[c]) with the W-1 inputs before x taken from `window` (or 0)."""
    T, C = x.shape
    W = w.shape[-1]
    history = torch.cat([torch.zeros(W - 1, C, dtype=x.dtype) if window is None else window, x])
    pre = torch.zeros(T, C, dtype=x.dtype)
    for t in range(T):
        for j in range(W):
            pre[t] += w[:, 0, j] * history[t + j]  # history[t + j] is x_{t-W+1+j}
    return pre * ref_sigmoid(pre), history[T:]


def ref_gate(f, A_log, dt_bias, lower_bound):
    H, K = f.shape[-2:]
    z = f + dt_bias.reshape(H, K)
    rate = torch.exp(A_log)[:, None]
    if lower_bound is None:
        return -rate * torch.log1p(torch.exp(z))
    return lower_bound * ref_sigmoid(rate * z)


def ref_l2(x, eps=1e-6):
    return x / torch.sqrt((x**2).sum(-1, keepdim=True) + eps)


def ref_recurrence(q, k, v, g, beta, scale, S0=None):
    """S_t = (I - b k k^T) Diag(exp g_t) S_{t-1} + b k v^T,  o_t = S_t^T (scale q_t), per head, as matrices."""
    T, H, K = k.shape
    V = v.shape[-1]
    o = torch.zeros(T, H, V, dtype=F64)
    S_final = torch.zeros(H, K, V, dtype=F64)
    eye = torch.eye(K, dtype=F64)
    for h in range(H):
        S = torch.zeros(K, V, dtype=F64) if S0 is None else S0[h].double().clone()
        for t in range(T):
            kt, b = k[t, h], beta[t, h]
            S = (eye - b * torch.outer(kt, kt)) @ torch.diag(torch.exp(g[t, h])) @ S + b * torch.outer(kt, v[t, h])
            o[t, h] = S.T @ (scale * q[t, h])
        S_final[h] = S
    return o, S_final


def ref_layer(layer: KimiDeltaAttention, x, state: KDAState | None = None):
    """The whole KDA layer in float64 from its parameters."""
    P = {name: p.detach().double() for name, p in layer.state_dict().items()}
    x = x.double()
    T = x.shape[0]
    H, K = layer.num_heads, layer.head_dim
    windows = [None] * 3 if state is None else [w.double() for w in state.conv]
    S0 = None if state is None else state.recurrent.double()

    def proj(name, inp):
        return inp @ P[f"{name}.weight"].T

    q, wq = ref_short_conv(proj("q_proj", x), P["q_conv1d.weight"], windows[0])
    k, wk = ref_short_conv(proj("k_proj", x), P["k_conv1d.weight"], windows[1])
    v, wv = ref_short_conv(proj("v_proj", x), P["v_conv1d.weight"], windows[2])
    q, k, v = ref_l2(q.reshape(T, H, K)), ref_l2(k.reshape(T, H, K)), v.reshape(T, H, K)
    f = proj("f_b_proj", proj("f_a_proj", x)).reshape(T, H, K)
    g = ref_gate(f, P["A_log"], P["dt_bias"], layer.gate_lower_bound)
    beta = ref_sigmoid(proj("b_proj", x))
    o, S = ref_recurrence(q, k, v, g, beta, K**-0.5, S0)
    z = proj("g_proj", x) if "g_proj.weight" in P else proj("g_b_proj", proj("g_a_proj", x))
    z = z.reshape(T, H, K)
    rms = torch.sqrt((o**2).mean(-1, keepdim=True) + layer.o_norm.eps)
    gated = o / rms * P["o_norm.weight"] * ref_sigmoid(z)
    y = proj("o_proj", gated.reshape(T, H * K))
    return y, S, torch.stack([wq, wk, wv])


def random_kda_inputs(T, H=2, K=8, V=6, dtype=F64, g_scale=1.0, with_state=False):
    """Inputs of the core recurrence: K != V catches a transposed state; g spans (-5 g_scale, 0)."""
    q = ref_l2(torch.randn(T, H, K, dtype=F64)).to(dtype)
    k = ref_l2(torch.randn(T, H, K, dtype=F64)).to(dtype)
    v = torch.randn(T, H, V, dtype=dtype)
    g = -5 * g_scale * torch.rand(T, H, K, dtype=dtype)
    beta = torch.rand(T, H, dtype=dtype)
    S0 = torch.randn(H, K, V, dtype=dtype) if with_state else None
    return q, k, v, g, beta, K**-0.5, S0


# --- fla's pure-torch references --------------------------------------------------------------------------


def _fla_kda_dir() -> Path:
    spec = importlib.util.find_spec("fla")  # locates the package without importing it (that needs triton)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("fla-core is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "ops" / "kda"


def fla_naive():
    """fla/ops/kda/naive.py only imports torch and einops, so it loads on its own from its file."""
    spec = importlib.util.spec_from_file_location("fla_kda_naive", _fla_kda_dir() / "naive.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fla_naive_gates():
    """naive_kda_gate and naive_kda_lowerbound_gate, taken out of fla/ops/kda/gate.py.

    That file imports triton and fla's triton utilities at the top, which fail on a CPU-only machine, but
    the two naive functions use only torch and F. So parse the file and exec just those two definitions
    (unchanged source) in a namespace holding torch and F.
    """
    path = _fla_kda_dir() / "gate.py"
    tree = ast.parse(path.read_text())
    wanted = {"naive_kda_gate", "naive_kda_lowerbound_gate"}
    funcs = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in wanted]
    assert {f.name for f in funcs} == wanted, f"{path} no longer defines {wanted}"
    namespace = {"torch": torch, "F": F}
    exec(compile(ast.Module(body=funcs, type_ignores=[]), str(path), "exec"), namespace)
    return namespace["naive_kda_gate"], namespace["naive_kda_lowerbound_gate"]


# === the functions =========================================================================================


@pytest.mark.parametrize("W", [2, 4])
@pytest.mark.parametrize("T", [1, 2, 9])
@pytest.mark.parametrize("with_window", [False, True])
def test_short_conv_matches_formula(W, T, with_window):
    C = 5
    x, w = torch.randn(T, C, dtype=F64), torch.randn(C, 1, W, dtype=F64)
    window = torch.randn(W - 1, C, dtype=F64) if with_window else None
    y, new_window = short_conv(x, w, window)
    y_ref, window_ref = ref_short_conv(x, w, window)
    check("short_conv vs formula (fp64)", y, y_ref, atol=1e-13)
    check("short_conv window vs formula", new_window, window_ref, atol=0.0)
    assert new_window.shape == (W - 1, C)


def test_short_conv_in_pieces_equals_one_pass():
    x, w = torch.randn(11, 6, dtype=F64), torch.randn(6, 1, 4, dtype=F64)
    y_full, window_full = short_conv(x, w)
    window, pieces = None, []
    for a, b in [(0, 1), (1, 3), (3, 4), (4, 11)]:
        y, window = short_conv(x[a:b], w, window)
        pieces.append(y)
    check("short_conv pieces vs one pass", torch.cat(pieces), y_full, atol=1e-14)
    check("short_conv window pieces vs one pass", window, window_full, atol=0.0)


@pytest.mark.parametrize("lower_bound", [-5.0, -2.0, None])
def test_kda_gate_matches_formula_and_fla(lower_bound):
    T, H, K = 7, 3, 4
    f, A_log, dt_bias = 3 * torch.randn(T, H, K, dtype=F64), torch.randn(H, dtype=F64), torch.randn(H * K, dtype=F64)
    g = kda_gate(f, A_log, dt_bias, lower_bound)
    check("kda_gate vs formula (fp64)", g, ref_gate(f, A_log, dt_bias, lower_bound), atol=1e-14)
    if lower_bound is not None:
        assert (g < 0).all() and (g >= lower_bound).all()  # open interval, but the sigmoid saturates in floats

    # fla computes in fp32 (`.float()` inside), so compare at fp32 rounding.
    naive_gate, naive_lowerbound_gate = fla_naive_gates()
    if lower_bound is None:
        fla_g = naive_gate(f, A_log, dt_bias, output_dtype=F64)
    else:
        fla_g = naive_lowerbound_gate(f, A_log, dt_bias, lower_bound=lower_bound, output_dtype=F64)
    check("kda_gate vs fla naive gate (fp32 inside fla)", g, fla_g, atol=1e-5, rtol=1e-5)


def test_kda_gate_keeps_low_precision_inputs_in_fp32():
    f = torch.randn(3, 2, 4).bfloat16()
    g = kda_gate(f, torch.randn(2).bfloat16(), torch.randn(8), -5.0)
    assert g.dtype == torch.float32


def test_l2_normalize_matches_fla_eps_placement():
    x = torch.randn(5, 3, 16, dtype=F64)
    check("l2_normalize vs formula (fp64)", l2_normalize(x), ref_l2(x), atol=1e-15)
    # eps sits inside the sqrt, added to the sum of squares (fla), not a clamp on the norm (F.normalize):
    tiny = torch.full((4,), 1e-4, dtype=F64)  # sum of squares 4e-8, well below eps = 1e-6
    check("l2_normalize eps placement", l2_normalize(tiny), tiny / math.sqrt(4e-8 + 1e-6), atol=1e-15)
    assert not torch.allclose(l2_normalize(tiny), F.normalize(tiny, dim=-1, eps=1e-6))
    assert l2_normalize(torch.zeros(3, dtype=F64)).eq(0).all()


@pytest.mark.parametrize("with_state", [False, True])
def test_kda_recurrent_matches_formula(with_state):
    q, k, v, g, beta, scale, S0 = random_kda_inputs(23, with_state=with_state)
    o, S = kda_recurrent(q, k, v, g, beta, scale, S0)
    o_ref, S_ref = ref_recurrence(q, k, v, g, beta, scale, S0)
    check("kda_recurrent vs formula (fp64)", o, o_ref, atol=1e-12)
    check("kda_recurrent state vs formula (fp64)", S, S_ref, atol=1e-12)
    o_c, S_c = kda_chunked(q, k, v, g, beta, scale, S0, chunk_size=8)
    check("kda_chunked vs formula (fp64)", o_c, o_ref, atol=1e-12)
    check("kda_chunked state vs formula (fp64)", S_c, S_ref, atol=1e-12)


@pytest.mark.parametrize("with_state", [False, True])
def test_kda_matches_fla_naive(with_state):
    """fla's layout: q/k/v/g [B, T, H, *], beta [B, T, H], state [B, H, K, V] (key-first, like ours)."""
    naive = fla_naive()
    T, chunk = 48, 16  # naive_chunk_kda needs T % chunk_size == 0
    q, k, v, g, beta, scale, S0 = random_kda_inputs(T, with_state=with_state)
    o, S = kda_recurrent(q, k, v, g, beta, scale, S0)
    o_c, S_c = kda_chunked(q, k, v, g, beta, scale, S0, chunk_size=chunk)
    batched = [x[None] for x in (q, k, v, g, beta)]
    fla_S0 = None if S0 is None else S0[None]
    # fla's naive functions compute in fp32 (`.to(torch.float)`), hence fp32 tolerances.
    fla_o, fla_S = naive.naive_recurrent_kda(*batched, scale=scale, initial_state=fla_S0, output_final_state=True)
    check("kda_recurrent vs fla naive_recurrent_kda (fp32 in fla)", o, fla_o[0], atol=2e-5, rtol=1e-5)
    check("kda_recurrent state vs fla naive_recurrent_kda", S, fla_S[0], atol=2e-5, rtol=1e-5)
    fla_o, fla_S = naive.naive_chunk_kda(*batched, scale=scale, initial_state=fla_S0, output_final_state=True,
                                         chunk_size=chunk)
    check("kda_chunked vs fla naive_chunk_kda (fp32 in fla)", o_c, fla_o[0], atol=2e-5, rtol=1e-5)
    check("kda_chunked state vs fla naive_chunk_kda", S_c, fla_S[0], atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("T", [1, 7, 64, 65, 200])
@pytest.mark.parametrize("chunk_size", [16, 64])
@pytest.mark.parametrize("with_state", [False, True])
def test_kda_chunked_equals_recurrent(T, chunk_size, with_state):
    q, k, v, g, beta, scale, S0 = random_kda_inputs(T, with_state=with_state)
    o_r, S_r = kda_recurrent(q, k, v, g, beta, scale, S0)
    o_c, S_c = kda_chunked(q, k, v, g, beta, scale, S0, chunk_size=chunk_size)
    check("kda_chunked vs kda_recurrent (fp64)", o_c, o_r, atol=1e-12)
    check("kda_chunked state vs kda_recurrent (fp64)", S_c, S_r, atol=1e-12)


@pytest.mark.parametrize("g_scale", [1.0, 10.0])
def test_kda_chunked_fp32_with_strong_decay_stays_finite(g_scale):
    """A 64-token chunk of strong decays sums to a log-decay of -320 and beyond: exp(+320) must never appear,
    and G_i - G_j must come from segment sums (a difference of running sums would lose |G| * eps, ~1e-5)."""
    q, k, v, g, beta, scale, S0 = random_kda_inputs(130, dtype=torch.float32, g_scale=g_scale, with_state=True)
    o_c, S_c = kda_chunked(q, k, v, g, beta, scale, S0)
    assert torch.isfinite(o_c).all() and torch.isfinite(S_c).all()
    o_r, S_r = kda_recurrent(*(x.double() for x in (q, k, v, g, beta)), scale, S0.double())
    check("kda_chunked fp32 (strong decay) vs recurrent fp64", o_c, o_r, atol=2e-6, rtol=1e-6)
    check("kda_chunked fp32 state (strong decay) vs recurrent fp64", S_c, S_r, atol=2e-6, rtol=1e-6)


def test_kda_empty_sequence_returns_initial_state():
    q, k, v, g, beta, scale, S0 = random_kda_inputs(0, with_state=True)
    for core in (kda_recurrent, kda_chunked):
        o, S = core(q, k, v, g, beta, scale, S0)
        assert o.shape == (0, 2, 6)
        check("empty sequence state", S, S0, atol=0.0)


# === the layer =============================================================================================


def test_parameter_names_and_shapes():
    D, H, K, W = 64, 3, 16, 4
    common = {
        "q_proj.weight": (H * K, D), "k_proj.weight": (H * K, D), "v_proj.weight": (H * K, D),
        "q_conv1d.weight": (H * K, 1, W), "k_conv1d.weight": (H * K, 1, W), "v_conv1d.weight": (H * K, 1, W),
        "A_log": (H,), "dt_bias": (H * K,), "f_a_proj.weight": (K, D), "f_b_proj.weight": (H * K, K),
        "b_proj.weight": (H, D), "o_norm.weight": (K,), "o_proj.weight": (D, H * K),
    }
    full = {**common, "g_proj.weight": (H * K, D)}
    low = {**common, "g_a_proj.weight": (K, D), "g_b_proj.weight": (H * K, K)}
    for variant, expected in [("k3", full), ("kimi_linear", low)]:
        layer = KimiDeltaAttention(tiny_config(**VARIANTS[variant]), layer_idx=0)
        assert {n: tuple(p.shape) for n, p in layer.state_dict().items()} == expected


def test_untrained_layer_is_well_behaved():
    """The default parameters give finite outputs and mild decays (the loader overwrites them anyway)."""
    layer = KimiDeltaAttention(tiny_config(), layer_idx=0)
    x = torch.randn(40, 64)
    y, state = layer(x)
    assert torch.isfinite(y).all() and torch.isfinite(state.recurrent).all()
    g = kda_gate(torch.zeros(1, 3, 16), layer.A_log, layer.dt_bias, layer.gate_lower_bound)
    assert (g < 0).all() and (g > -2.5).all()


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("T", [5, 37])  # 5 takes the recurrent core, 37 the chunked one
@pytest.mark.parametrize("with_state", [False, True])
def test_layer_matches_formula(variant, T, with_state):
    layer = make_layer(variant)
    x = torch.randn(T, 64, dtype=F64)
    state = random_state(layer) if with_state else None
    y, new = layer(x, state)
    y_ref, S_ref, conv_ref = ref_layer(layer, x, state)
    check("layer output vs formula (fp64)", y, y_ref, atol=1e-11, rtol=1e-11)
    check("layer recurrent state vs formula (fp64)", new.recurrent, S_ref, atol=1e-11, rtol=1e-11)
    check("layer conv window vs formula", new.conv, conv_ref, atol=1e-13)
    assert y.dtype == F64 and new.recurrent.dtype == F64


def _run_in_pieces(layer, x, cuts):
    state, ys = None, []
    for a, b in zip([0, *cuts], [*cuts, x.shape[0]], strict=True):
        y, state = layer(x[a:b], state)
        ys.append(y)
    return torch.cat(ys), state


@pytest.mark.parametrize("variant", ["k3", "kimi_linear"])
@pytest.mark.parametrize("cuts", [[1], [2], [3], [20], [64], [69], [2, 5, 40]])
def test_prefix_then_continue_equals_one_pass(variant, cuts):
    layer = make_layer(variant)
    x = torch.randn(70, 64, dtype=F64)  # one pass: two chunks, the second partial
    y_full, state_full = layer(x)
    y, state = _run_in_pieces(layer, x, cuts)
    check("prefix-then-continue output vs one pass (fp64)", y, y_full, atol=1e-11, rtol=1e-11)
    check("prefix-then-continue state vs one pass (fp64)", state.recurrent, state_full.recurrent, atol=1e-11)
    check("prefix-then-continue conv vs one pass", state.conv, state_full.conv, atol=1e-13)


@pytest.mark.parametrize("variant", ["k3", "kimi_linear"])
def test_decode_loop_equals_one_pass(variant):
    layer = make_layer(variant)
    x = torch.randn(40, 64, dtype=F64)
    y_full, state_full = layer(x)
    y, state = _run_in_pieces(layer, x, list(range(1, 40)))
    check("decode loop output vs one pass (fp64)", y, y_full, atol=1e-11, rtol=1e-11)
    check("decode loop state vs one pass (fp64)", state.recurrent, state_full.recurrent, atol=1e-11)
    check("decode loop conv vs one pass", state.conv, state_full.conv, atol=1e-13)


def test_new_state_is_the_zero_history():
    layer = make_layer("k3")
    state = layer.new_state()
    assert state.recurrent.shape == (3, 16, 16) and state.conv.shape == (3, 3, 48)
    assert state.recurrent.dtype == F64 and not state.recurrent.any() and not state.conv.any()
    bf16 = layer.new_state(torch.bfloat16)
    assert bf16.recurrent.dtype == torch.float32 and bf16.conv.dtype == torch.bfloat16
    x = torch.randn(6, 64, dtype=F64)
    check("explicit zero state vs None", layer(x, state)[0], layer(x)[0], atol=0.0)
    assert layer.empty_state().recurrent.shape == state.recurrent.shape


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 1e-1)])
def test_low_precision_layer_tracks_fp64(dtype, tol):
    """As the checkpoint stores them, A_log, dt_bias and the conv kernels stay fp32 in a bf16 model."""
    layer64 = make_layer("k3")
    layer = make_layer("k3", dtype=F64)
    layer.load_state_dict(layer64.state_dict())
    layer = layer.to(dtype)
    for name in ("A_log", "dt_bias", "q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight"):
        param = layer.get_parameter(name)
        param.data = layer64.get_parameter(name).data.float()
    x = torch.randn(30, 64, dtype=F64)
    y64, s64 = layer64(x)
    state = None
    ys = []
    for a, b in [(0, 20), (20, 21), (21, 30)]:
        y, state = layer(x[a:b].to(dtype), state)
        ys.append(y)
    assert ys[0].dtype == dtype and state.recurrent.dtype == torch.float32 and state.conv.dtype == dtype
    scale = y64.abs().max().item()
    check(f"{dtype} layer vs fp64 (relative to max |y|)", torch.cat(ys) / scale, y64 / scale, atol=tol)
    check(f"{dtype} state vs fp64", state.recurrent, s64.recurrent, atol=tol * s64.recurrent.abs().max().item())


def test_bad_state_and_layer_are_named():
    layer = make_layer("k3")
    wrong = KDAState(recurrent=torch.zeros(3, 16, 16, dtype=F64), conv=torch.zeros(3, 2, 48, dtype=F64))
    with pytest.raises(ValueError, match="conv"):
        layer(torch.randn(2, 64, dtype=F64), wrong)
    with pytest.raises(ValueError, match="recurrent"):
        KDAState(recurrent=torch.zeros(16, 16), conv=torch.zeros(3, 3, 48))
    with pytest.raises(ValueError, match="kda_layers"):
        KimiDeltaAttention(tiny_config(), layer_idx=3)
    with pytest.raises(ConfigError, match="gate_lower_bound"):
        tiny_config(k3=True, lower_bound=None)
