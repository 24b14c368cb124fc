"""Kimi Delta Attention (KDA), the linear-attention layer of Kimi K3 and Kimi-Linear.

Per token x_t (already `input_layernorm`-ed), with H heads of size K = V = head_dim:

    q_t, k_t, v_t = SiLU(ShortConv(W_q x)), SiLU(ShortConv(W_k x)), SiLU(ShortConv(W_v x))   (depthwise, causal)
    q_t, k_t      = q_t / ||q_t||, k_t / ||k_t||                                       (per head, eps 1e-6 inside)
    g_t           = lb * sigmoid(exp(A_log) * (W_fb W_fa x + dt_bias))     (K3, lb = gate_lower_bound = -5)
                  = -exp(A_log) * softplus(W_fb W_fa x + dt_bias)          (Kimi-Linear)
    beta_t        = sigmoid(W_b x)                                                      (one scalar per head)
    S_t           = (I - beta_t k_t k_t^T) Diag(exp g_t) S_{t-1} + beta_t k_t v_t^T     (S in R^{K x V}, fp32+)
    o_t           = S_t^T (K^-1/2 q_t)
    y_t           = W_o [ RMSNorm_head(o_t) * sigmoid(z_t) ],   z_t = W_g x  or  W_gb W_ga x

g is a per-key-channel log-decay, so Diag(exp g_t) scales each row of S. The recurrence has two equivalent
evaluations here: `kda_recurrent` (token by token, the decode oracle) and `kda_chunked` (chunkwise-parallel:
a UT/WY transform inside each chunk, state hand-over between chunks). They agree to rounding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import KimiK3Config
from .norm import at_least_fp32

# fla's l2norm (`fla/modules/norm/l2norm.py`, and the in-kernel one of `fused_recurrent.py`) computes
# x / sqrt(sum(x^2) + eps): eps is added to the *sum of squares* inside the sqrt, unlike F.normalize's
# x / max(||x||, eps). With unit-scale inputs the two differ by ~eps / (2 ||x||^2).
L2_NORM_EPS = 1e-6

# Chunk length of the chunkwise form (fla's `chunk_kda` and HF use 64).
CHUNK_SIZE = 64

# Up to this many tokens the layer runs the token-by-token recurrence, above it the chunked form. Both give
# the same numbers to rounding (tests/models/kimi_k3/test_kda.py), so this is only about speed: per token and head
# both do O(K*V + L*K) work on CPU, and the recurrence's Python loop only costs more once T is in the tens, while
# a partial chunk for 1..16 tokens wastes its pairwise-decay set-up. Decode (T = 1, like HF's fused_recurrent
# path) and short speculative-verification windows take the recurrence; prefill takes chunks.
RECURRENT_MAX_TOKENS = 16


# --- the per-sequence state --------------------------------------------------------------------------


@dataclass
class KDAState:
    """Everything one KDA layer carries from one call to the next for one sequence.

    recurrent: [H, K, V]  S per head, *key-first* (S in R^{K x V}; fla's `[B, H, K, V]` without B, not
               HF's transposed `[B, H, V, K]` cache layout). Kept in at least fp32.
    conv:      [3, W-1, width]  the last W-1 *pre-convolution* inputs (W_q x, W_k x, W_v x for index 0, 1, 2),
               oldest row first, in the activation dtype; zeros at sequence start (the conv's zero history).
    """

    recurrent: Tensor
    conv: Tensor

    def __post_init__(self) -> None:
        if self.recurrent.dim() != 3 or self.conv.dim() != 3 or self.conv.shape[0] != 3:
            raise ValueError(
                f"KDAState: recurrent must be [H, K, V] and conv [3, W-1, width]; got recurrent "
                f"{tuple(self.recurrent.shape)} and conv {tuple(self.conv.shape)}"
            )

    @classmethod
    def zeros(cls, num_heads: int, head_dim: int, conv_kernel: int, dtype: torch.dtype, device=None) -> KDAState:
        """The state at sequence start: S = 0 (in at least fp32) and an all-zero conv window in `dtype`."""
        state_dtype = torch.promote_types(torch.float32, dtype)
        return cls(
            recurrent=torch.zeros(num_heads, head_dim, head_dim, dtype=state_dtype, device=device),
            conv=torch.zeros(3, conv_kernel - 1, num_heads * head_dim, dtype=dtype, device=device),
        )

    def clone(self) -> KDAState:
        return KDAState(recurrent=self.recurrent.clone(), conv=self.conv.clone())


# --- the pieces, as functions -------------------------------------------------------------------------


def short_conv(x: Tensor, weight: Tensor, window: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """SiLU of a causal depthwise convolution, continuing from `window`.

    x: [T, C]; weight: [C, 1, W]; window: [W-1, C] (the W-1 inputs before x, oldest first; None = zeros).
    y_t[c] = SiLU( sum_j weight[c, 0, j] * x_{t-W+1+j}[c] ), so weight[c, 0, W-1] multiplies the current token.
    Computed in at least fp32 (the checkpoint's conv weights are F32, as is fla's kernel), returned in x.dtype.
    Returns (y [T, C], the new window [W-1, C] in x.dtype).
    """
    T, C = x.shape
    W = weight.shape[-1]
    if weight.shape != (C, 1, W):
        raise ValueError(f"short_conv: weight must be [{C}, 1, W] for x of width {C}, got {tuple(weight.shape)}")
    if window is None:
        window = x.new_zeros(W - 1, C)
    if window.shape != (W - 1, C):
        raise ValueError(f"short_conv: window must be [{W - 1}, {C}], got {tuple(window.shape)}")
    history = torch.cat([window.to(x.dtype), x], dim=0)  # [W-1+T, C]
    xf = at_least_fp32(history)
    taps = xf.unfold(0, W, 1)  # [T, C, W]: taps[t, c, j] = x_{t-W+1+j}[c]
    y = F.silu((taps * weight[:, 0, :].to(xf.dtype)).sum(-1))
    return y.to(x.dtype), history[history.shape[0] - (W - 1) :]


def kda_gate(f: Tensor, A_log: Tensor, dt_bias: Tensor, lower_bound: float | None) -> Tensor:
    """The per-channel log-decay g [T, H, K] from the gate pre-activation f = W_fb W_fa x, viewed [T, H, K].

    K3 (bounded, lies in (lower_bound, 0)):  g = lower_bound * sigmoid(exp(A_log[h]) * (f + dt_bias))
    Kimi-Linear (lower_bound None):           g = -exp(A_log[h]) * softplus(f + dt_bias)
    A_log: [H]; dt_bias: [H*K], channel h*K + c belongs to head h. Computed and returned in at least fp32.
    """
    H, K = f.shape[-2:]
    z = at_least_fp32(f) + at_least_fp32(dt_bias).view(H, K)
    rate = at_least_fp32(A_log).view(H, 1).exp()
    if lower_bound is None:
        return -rate * F.softplus(z)
    return lower_bound * torch.sigmoid(rate * z)


def l2_normalize(x: Tensor, eps: float = L2_NORM_EPS) -> Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, in at least fp32 (as fla's l2norm; see L2_NORM_EPS)."""
    xf = at_least_fp32(x)
    return xf / torch.sqrt((xf * xf).sum(-1, keepdim=True) + eps)


def _math_dtype(*xs: Tensor | None) -> torch.dtype:
    """The promoted dtype of the given tensors, but at least fp32: the dtype of the state math."""
    dtype = torch.float32
    for x in xs:
        if x is not None:
            dtype = torch.promote_types(dtype, x.dtype)
    return dtype


def _start_state(initial_state: Tensor | None, H: int, K: int, V: int, dtype: torch.dtype, device) -> Tensor:
    if initial_state is None:
        return torch.zeros(H, K, V, dtype=dtype, device=device)
    if initial_state.shape != (H, K, V):
        raise ValueError(f"initial_state must be [H, K, V] = [{H}, {K}, {V}], got {tuple(initial_state.shape)}")
    return initial_state.to(dtype)


def kda_recurrent(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float, initial_state: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """The gated delta rule, one token at a time.

    q, k: [T, H, K] (already L2-normalised); v: [T, H, V]; g: [T, H, K] log-decay; beta: [T, H];
    initial_state: [H, K, V] or None (zeros). Per token and head:
        S <- Diag(exp g_t) S;   S <- S + k_t (beta_t (v_t - S^T k_t))^T;   o_t = S^T (scale q_t).
    Returns (o [T, H, V] in v.dtype, final state [H, K, V] in the math dtype, at least fp32).
    """
    dtype, out_dtype = _math_dtype(q, k, v, g, beta, initial_state), v.dtype
    T, H, K = k.shape
    V = v.shape[-1]
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    S = _start_state(initial_state, H, K, V, dtype, v.device)
    o = torch.empty(T, H, V, dtype=dtype, device=v.device)
    for t in range(T):
        S = g[t].exp()[..., None] * S  # decay each key-channel row
        predicted = torch.einsum("hk,hkv->hv", k[t], S)  # S^T k_t, what the memory recalls for k_t
        S = S + torch.einsum("hk,hv->hkv", k[t], beta[t, :, None] * (v[t] - predicted))
        o[t] = torch.einsum("hk,hkv->hv", scale * q[t], S)
    return o.to(out_dtype), S


def _pairwise_decay(g: Tensor) -> Tensor:
    """exp(G_i - G_j) for j <= i and 0 for j > i, where G is the cumulative sum of g: [H, L, K] -> [H, L, L, K].

    G_i - G_j is summed as the segment g_{j+1} + ... + g_i, not subtracted from the running sum: over a chunk
    G grows to -320 (K3's gate, unbounded in Kimi-Linear's), and G_i - G_j for nearby tokens would then carry
    an absolute error of |G| * eps, i.e. ~2e-5 relative in fp32. Nor is it exp(G_i) * exp(-G_j): exp(320)
    overflows fp32. Entries j > i become -inf before the exp, so they are exactly 0 (never inf * 0 = nan).
    """
    H, L, K = g.shape
    later = torch.ones(L, L, dtype=torch.bool, device=g.device).tril(-1)[None, :, :, None]  # [m, j]: m > j
    # segment[i, j] = sum over m <= i of [m > j] g_m = g_{j+1} + ... + g_i
    segment = g[:, :, None, :].expand(H, L, L, K).masked_fill(~later, 0).cumsum(dim=1)
    causal = torch.ones(L, L, dtype=torch.bool, device=g.device).tril()[None, :, :, None]
    return segment.masked_fill(~causal, float("-inf")).exp()


def _kda_chunk(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, S: Tensor) -> tuple[Tensor, Tensor]:
    """One chunk of L tokens, head-major: q, k, g [H, L, K] (q already scaled), v [H, L, V], beta [H, L], S [H, K, V].

    With G_i = g_1 + ... + g_i (cumulative log-decay inside the chunk) and S_0 the state before the chunk, the
    recurrence unrolls to S_i = e^{G_i} S_0 + sum_{j<=i} e^{G_i - G_j} k_j d_j^T, where d_j is token j's write
    d_j = beta_j (v_j - (Diag(e^{g_j}) S_{j-1})^T k_j). Substituting S_{j-1} gives a triangular system
        (I + A) d = Diag(beta) (V - (K * e^G) S_0),   A_ij = beta_i k_i^T Diag(e^{G_i - G_j}) k_j  (j < i),
    solved once per chunk by the UT transform T = (I + A)^{-1} Diag(beta): W = T (K * e^G), U = T V, d = U - W S_0
    (W and U do not depend on S_0). Then
        o_i  = (q_i * e^{G_i})^T S_0 + sum_{j<=i} (q_i^T Diag(e^{G_i - G_j}) k_j) d_j
        S_L  = e^{G_L} S_0 + sum_j e^{G_L - G_j} k_j d_j^T.
    """
    L = k.shape[1]
    G = g.cumsum(dim=1)
    decay = _pairwise_decay(g)  # [H, L, L, K], decay[:, i, j] = e^{G_i - G_j}
    # kk[i, j] = k_i^T Diag(e^{G_i - G_j}) k_j and qk[i, j] = q_i^T Diag(e^{G_i - G_j}) k_j (0 for j > i),
    # both from one decayed-key tensor (a batched matmul: much faster than a 3-operand einsum).
    decayed_k = decay * k[:, None, :, :]
    kk, qk = (decayed_k @ torch.stack([k, q], dim=-1)).unbind(-1)
    strictly_lower = torch.ones(L, L, dtype=torch.bool, device=k.device).tril(-1)
    A = beta[:, :, None] * kk * strictly_lower
    eye = torch.eye(L, dtype=k.dtype, device=k.device).expand_as(A)
    ut = torch.linalg.solve_triangular(eye + A, torch.diag_embed(beta), upper=False, unitriangular=True)
    w, u = ut @ (k * G.exp()), ut @ v
    d = u - w @ S  # [H, L, V]

    o = (q * G.exp()) @ S + qk @ d
    S = G[:, -1].exp()[..., None] * S + (decay[:, -1] * k).transpose(1, 2) @ d  # decay[:, -1, j] = e^{G_L - G_j}
    return o, S


def kda_chunked(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float,
    initial_state: Tensor | None = None,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[Tensor, Tensor]:
    """The same recurrence as `kda_recurrent`, evaluated chunkwise-parallel (see `_kda_chunk`).

    Same arguments and results; T need not be a multiple of chunk_size (the last chunk is just shorter).
    """
    if chunk_size < 1:
        raise ValueError(f"kda_chunked: chunk_size must be >= 1, got {chunk_size}")
    dtype, out_dtype = _math_dtype(q, k, v, g, beta, initial_state), v.dtype
    T, H, K = k.shape
    V = v.shape[-1]
    # head-major for the per-chunk matrix algebra
    q, k, v, g, beta = (x.to(dtype).transpose(0, 1) for x in (q, k, v, g, beta))
    q = scale * q
    S = _start_state(initial_state, H, K, V, dtype, v.device)
    outs = []
    for start in range(0, T, chunk_size):
        c = slice(start, start + chunk_size)
        o_c, S = _kda_chunk(q[:, c], k[:, c], v[:, c], g[:, c], beta[:, c], S)
        outs.append(o_c)
    o = torch.cat(outs, dim=1) if outs else v.new_zeros(H, 0, V)
    return o.transpose(0, 1).to(out_dtype), S


# --- the layer ------------------------------------------------------------------------------------


class ShortConv(nn.Module):
    """Holds a depthwise causal conv kernel as `weight` [C, 1, W] (the checkpoint's `{q,k,v}_conv1d.weight`)."""

    def __init__(self, channels: int, kernel_size: int):
        super().__init__()
        # nn.Conv1d's default for a depthwise kernel (fan_in = W), as fla's ShortConvolution starts from.
        bound = 1.0 / math.sqrt(kernel_size)
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size).uniform_(-bound, bound))

    def forward(self, x: Tensor, window: Tensor | None) -> tuple[Tensor, Tensor]:
        return short_conv(x, self.weight, window)


class GatedHeadNorm(nn.Module):
    """o_norm: RMSNorm over each head's last dim, then times sigmoid(gate); `weight` [head_dim] is shared by heads.

    Unlike the residual-stream RMSNorm (norm.py), the weight and the gate multiply in fp32 before the single
    cast back, as fla's FusedRMSNormGated(activation='sigmoid') and HF's KimiLinearRMSNormGated do.
    """

    def __init__(self, head_dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(head_dim))
        self.eps = eps

    def forward(self, o: Tensor, gate: Tensor) -> Tensor:
        of = at_least_fp32(o)
        normed = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.to(of.dtype) * normed * torch.sigmoid(at_least_fp32(gate).to(of.dtype))).to(o.dtype)


def _default_A_log(num_heads: int) -> Tensor:
    # fla's init draws exp(A_log) from U(1, 16); spread evenly over the heads instead, so a fresh module
    # is deterministic.
    return torch.linspace(1.0, 16.0, num_heads).log()


def _default_dt_bias(width: int) -> Tensor:
    # fla's init: dt log-uniform in [1e-3, 1e-1], stored as softplus^-1(dt) = dt + log(-expm1(-dt));
    # here dt is spread geometrically over the channels instead of drawn.
    dt = torch.logspace(math.log10(1e-3), math.log10(1e-1), width)
    return dt + torch.log(-torch.expm1(-dt))


class KimiDeltaAttention(nn.Module):
    """One KDA layer (`model.layers.N.self_attn`). Attribute names are the checkpoint's tensor names.

    forward(x [T, D], state) -> (y [T, D], new state). The core runs `kda_recurrent` for at most
    RECURRENT_MAX_TOKENS tokens and `kda_chunked` otherwise (same numbers to rounding, see the constant).
    """

    def __init__(self, config: KimiK3Config, layer_idx: int):
        super().__init__()
        la = config.linear_attn
        if not config.is_kda_layer(layer_idx):
            raise ValueError(f"KimiDeltaAttention: layer {layer_idx} (0-based) is not in linear_attn_config.kda_layers")
        self.layer_idx = layer_idx
        self.num_heads, self.head_dim = la.num_heads, la.head_dim
        self.conv_kernel = la.short_conv_kernel_size
        self.gate_lower_bound = la.gate_lower_bound
        self.use_full_rank_gate = la.use_full_rank_gate
        # Chunk length of the chunked form. Training sets it shorter: the pairwise-decay tensor costs
        # O(T * chunk * width), which dominates a small model's backward on CPU.
        self.chunk_size = CHUNK_SIZE
        D, width, hd = config.hidden_size, la.width, la.head_dim

        self.q_proj = nn.Linear(D, width, bias=False)
        self.k_proj = nn.Linear(D, width, bias=False)
        self.v_proj = nn.Linear(D, width, bias=False)
        self.q_conv1d = ShortConv(width, self.conv_kernel)
        self.k_conv1d = ShortConv(width, self.conv_kernel)
        self.v_conv1d = ShortConv(width, self.conv_kernel)
        self.A_log = nn.Parameter(_default_A_log(la.num_heads))
        self.dt_bias = nn.Parameter(_default_dt_bias(width))
        self.f_a_proj = nn.Linear(D, hd, bias=False)
        self.f_b_proj = nn.Linear(hd, width, bias=False)
        self.b_proj = nn.Linear(D, la.num_heads, bias=False)
        if self.use_full_rank_gate:
            self.g_proj = nn.Linear(D, width, bias=False)
        else:
            self.g_a_proj = nn.Linear(D, hd, bias=False)
            self.g_b_proj = nn.Linear(hd, width, bias=False)
        self.o_norm = GatedHeadNorm(hd, config.rms_norm_eps)
        self.o_proj = nn.Linear(width, D, bias=False)

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5

    def new_state(self, dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> KDAState:
        """The state at sequence start, for activations of `dtype` (default: this module's dtype)."""
        dtype = dtype or self.q_proj.weight.dtype
        device = device or self.q_proj.weight.device
        return KDAState.zeros(self.num_heads, self.head_dim, self.conv_kernel, dtype, device)

    empty_state = new_state

    def _heads(self, x: Tensor) -> Tensor:
        return x.view(x.shape[0], self.num_heads, self.head_dim)

    def _output_gate(self, x: Tensor) -> Tensor:
        return self.g_proj(x) if self.use_full_rank_gate else self.g_b_proj(self.g_a_proj(x))

    def _check_state(self, state: KDAState) -> None:
        H, K, W = self.num_heads, self.head_dim, self.conv_kernel
        if state.recurrent.shape != (H, K, K) or state.conv.shape != (3, W - 1, H * K):
            raise ValueError(
                f"KDAState for layer {self.layer_idx} must have recurrent [{H}, {K}, {K}] and conv "
                f"[3, {W - 1}, {H * K}]; got {tuple(state.recurrent.shape)} and {tuple(state.conv.shape)} "
                "(was it made by another layer's or model's new_state?)"
            )

    def forward(self, x: Tensor, state: KDAState | None = None) -> tuple[Tensor, KDAState]:
        if x.dim() != 2:
            raise ValueError(f"KimiDeltaAttention: x must be [T, hidden_size], got {tuple(x.shape)}")
        state = state if state is not None else self.new_state(x.dtype, x.device)
        self._check_state(state)

        q, q_window = self.q_conv1d(self.q_proj(x), state.conv[0])
        k, k_window = self.k_conv1d(self.k_proj(x), state.conv[1])
        v, v_window = self.v_conv1d(self.v_proj(x), state.conv[2])
        q, k, v = l2_normalize(self._heads(q)), l2_normalize(self._heads(k)), self._heads(v)
        g = kda_gate(self._heads(self.f_b_proj(self.f_a_proj(x))), self.A_log, self.dt_bias, self.gate_lower_bound)
        beta = torch.sigmoid(at_least_fp32(self.b_proj(x)))

        if x.shape[0] <= RECURRENT_MAX_TOKENS:
            o, recurrent = kda_recurrent(q, k, v, g, beta, self.scale, state.recurrent)
        else:
            o, recurrent = kda_chunked(q, k, v, g, beta, self.scale, state.recurrent, self.chunk_size)

        o = self.o_norm(o, self._heads(self._output_gate(x)))
        y = self.o_proj(o.reshape(x.shape[0], -1))
        return y, KDAState(recurrent=recurrent, conv=torch.stack([q_window, k_window, v_window]))
