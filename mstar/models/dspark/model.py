"""The DSpark draft for Kimi K3 (Inferact/Kimi-K3-DSpark) as a plain PyTorch reference.

Context (once per accepted target token; DSpark paper eq. 2 and 3):

    H_ctx = context_norm(context_proj([tap_l1 ; ... ; tap_lm]))             taps: the target's raw prefix-sum stream
    for each draft layer i:  [c | k_pe] = kv_a_proj_with_mqa_i(H_ctx)        (no input_layernorm on this path)
                             row = [kv_a_layernorm_i(c) | RoPE(k_pe, pos)]   -> that layer's persistent latent cache

Block proposal (anchor = the last token the target emitted, at position p; k drafts):

    x = embed([anchor, mask, ..., mask])                      k inputs at positions p .. p + k - 1
    per layer: x += MLA(input_layernorm(x))                   queries see every context row at a position < p and
               x += SwiGLU(post_attention_layernorm(x))       every block slot (bidirectional inside the block)
    h = final_norm(x);  U = lm_head(h)                        slot j predicts the token at p + j + 1 (DSpark: the
                                                              anchor slot already predicts draft 1, unlike DFlash)
    for j = 1 .. k (left to right):  logits_j = U_j + W2 W1[x_{j-1}],  x_0 = anchor      (Markov head, eq. 4-5)
                                     x_j = argmax, or a draw from q_j = softmax(logits_j / T)
    c_j = sigmoid(w . [h_j ; W1[x_{j-1}]] + b)                (confidence head, eq. 7; not used for verification)

The block's own K/V rows are scratch: they are built, attended over and dropped, never written to the cache.
Inference (`context_kv`, `blocks_hidden`: no autograd) and the trainer (mstar/training/draft.py, many blocks in
one masked attention) run the same differentiable cores, `context_rows` and `block_forward`.

The engine drafts all verify rows of a step together (`propose_blocks`): the B blocks run as one padded
[B, max k, D] forward, each over its own request's context rows (padded to the longest, masked to its own
length), with one lm_head GEMM; the Markov chain runs once for all greedy blocks, and per block for sampled ones
(each request's generator draws as it would alone). `propose` is the same path with B = 1.

The draft has no embedding or lm_head of its own: `propose` takes the *target's* `embed_tokens` and `lm_head`
as arguments (any callables ids -> [k, D] and [k, D] -> [k, V]), so one draft object serves whatever target
copy (dtype, device) the caller holds. The checkpoint's `embed_tokens.weight` copy is never loaded.

Numerics with their sources:
  * MLA is DeepSeek-V3 style with RoPE on the 64-wide q_pe/k_pe slice (interleaved yarn, see rope.py), no output
    gate, v_head_dim per head, softmax scale `cfg.softmax_scale` = 192^-0.5 * mscale^2 (vLLM
    `vllm/models/kimi_k3/nvidia/mla.py`, use_rope=True path, which `dspark_mla.py` builds for the draft).
  * Every RMSNorm, q_a_layernorm and kv_a_layernorm included, uses `cfg.rms_norm_eps` (1e-5). Unlike the
    target (whose HF code leaves q_a/kv_a at the 1e-6 default, mla.py LATENT_NORM_EPS), the draft has no HF
    modeling code, and every public implementation of it passes rms_norm_eps: vLLM `kimi_k3/nvidia/mla.py`
    (`RMSNorm(q_lora_rank, eps=config.rms_norm_eps)`, same for kv_a; also the eps its fused context writer
    reads in `dspark_mla.py`), TokenSpeed `kimi_k3_dspark.py` (DeepseekV3AttentionMLA), and TorchSpec's MLA
    draft `torchspec/models/draft/deepseek_eagle.py` (the trainer named by the config's `_torchspec_version`).
  * The confidence input is [h_j ; W1[x_{j-1}]] in that order (TorchSpec `torchspec/models/dspark.py`:
    `torch.cat([hidden_4d, prev_emb], dim=-1)`, with prev = [anchor, labels[:-1]]; research notes
    dspark.md section 1.4).
  * Attention softmax, norms' statistics, the Markov/temperature/softmax of q and the confidence sigmoid run in
    at least fp32 (`at_least_fp32`), so the float64 reference stays exact.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mstar.kernels.sampling_masks import min_p_mask, top_k_mask, top_p_mask
from mstar.kernels.temperature import scale_by_temperature_finite
from mstar.models.dspark.config import DSparkConfig
from mstar.models.dspark.rope import YarnRotaryEmbedding
from mstar.models.dspark.weights import load_dspark_checkpoint
from mstar.models.kimi_k3.norm import RMSNorm, at_least_fp32

Embed = Callable[[Tensor], Tensor]  # token ids [k] -> embeddings [k, D] (the target's embed_tokens)
LMHead = Callable[[Tensor], Tensor]  # hidden [k, D] -> logits [k, V] (the target's lm_head)
Norm = Callable[[RMSNorm, Tensor], Tensor]  # (an RMSNorm, x) -> its output; the GPU path passes a one-launch kernel
# x [T, ..., rope] -> x rotated to the positions of the call's rows; None: `DSparkMLA.rotate`. The GPU path passes
# one that holds the step's cos/sin tables (built once for every layer) and rotates in one launch.
Rope = Callable[[Tensor], Tensor]
# greedy Markov chain: (U [B, k, V], anchors [B]) -> tokens [B, k]; None: `markov_sample`. The GPU path passes a
# kernel of one launch a slot (kernels/markov_chain.py).
GreedyChain = Callable[[Tensor, Tensor], Tensor]


def module_norm(norm: RMSNorm, x: Tensor) -> Tensor:
    """The reference's RMSNorm: the module itself (torch ops)."""
    return norm(x)


# --- per-request state ------------------------------------------------------------------------------


@dataclass
class DraftCache:
    """One request's persistent draft state: per draft layer, one latent row per accepted context token.

    rows[i] is [L, kv_lora_rank + qk_rope_head_dim] = [kv_a_layernorm(c) | RoPE(k_pe)] for layer i (576 wide in
    the real draft); row t belongs to position t. `append` and `trim` change the cache in place.
    """

    rows: list[Tensor]

    def __post_init__(self) -> None:
        if not self.rows:
            raise ValueError("DraftCache needs one rows tensor per draft layer; got none")
        shapes = {(r.dim(), r.shape[0], r.shape[-1]) for r in self.rows}
        if len(shapes) != 1 or next(iter(shapes))[0] != 2:
            raise ValueError(
                "DraftCache rows must all be [L, width] with the same L and width; got shapes "
                f"{[tuple(r.shape) for r in self.rows]}"
            )

    @classmethod
    def empty(cls, cfg: DSparkConfig, *, dtype: torch.dtype, device=None) -> DraftCache:
        width = cfg.kv_cache_width
        return cls(rows=[torch.empty(0, width, dtype=dtype, device=device) for _ in range(cfg.num_hidden_layers)])

    @property
    def num_tokens(self) -> int:
        """Context tokens cached (positions 0 .. num_tokens - 1)."""
        return self.rows[0].shape[0]

    def __len__(self) -> int:
        return self.num_tokens

    @property
    def width(self) -> int:
        return self.rows[0].shape[1]

    def append(self, rows: Sequence[Tensor]) -> None:
        """Add the rows of new context tokens (one [T, width] tensor per layer, as `context_kv` returns)."""
        if len(rows) != len(self.rows):
            raise ValueError(f"append got rows for {len(rows)} layers; this cache has {len(self.rows)} draft layers")
        new = {(r.dim(), r.shape[0], r.shape[-1], r.dtype) for r in rows}
        if len(new) != 1:
            shapes = [tuple(r.shape) for r in rows]
            raise ValueError(f"append: every layer needs the same [T, width] rows and dtype; got {shapes}")
        ndim, _, width, dtype = next(iter(new))
        if ndim != 2 or width != self.width or dtype != self.rows[0].dtype:
            raise ValueError(
                f"append: rows must be [T, {self.width}] {self.rows[0].dtype}; got {tuple(rows[0].shape)} {dtype}"
            )
        self.rows = [torch.cat([old, r]) for old, r in zip(self.rows, rows, strict=True)]

    def trim(self, n: int) -> None:
        """Keep the first n context tokens (drop rows that belonged to rejected tokens)."""
        if not 0 <= n <= self.num_tokens:
            raise ValueError(f"trim(n={n}): n must be in 0..{self.num_tokens} (the cached context tokens)")
        self.rows = [r[:n] for r in self.rows]

    def clone(self) -> DraftCache:
        return DraftCache(rows=[r.clone() for r in self.rows])


@dataclass
class DraftProposal:
    """One block of drafts and the exact distributions they came from: what verification reads.

    tokens       [k]     the drafts x_1 .. x_k (long)
    probs        [k, V]  q_j = softmax((U_j + W2 W1[x_{j-1}]) / T), top-k/top-p/min-p masked, the distribution
                         x_j was drawn from (one-hot of the argmax of U_j + W2 W1[x_{j-1}] when greedy), where
                         U_j = lm_head(h_j) and h_j are the block's final-normed hidden states (`blocks_hidden`)

    The confidence head (c_j, `confidence`) is not run here: verification does not read it; training does.
    """

    tokens: Tensor
    probs: Tensor


@dataclass(frozen=True)
class DraftSampling:
    """How one block's drafts are drawn: greedy at temperature 0, else from q_j (see `K3DSparkModel.propose`)."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    generator: torch.Generator | None = None


@dataclass(frozen=True)
class BlockBatch:
    """B blocks drafted in one forward. Block b is [anchors[b], mask x (num_drafts[b] - 1)] at positions
    starts[b] + j; it sees the context rows at positions < starts[b] and its own slots, as it would alone.

    anchors, starts  [B] long, on the draft's device (the host values are checked by `check_block`)
    num_drafts       k_b per block, on the host: they set the padded shape [B, max k_b]
    context          per draft layer, [B, context_len, width]; row s of block b holds position s. Rows at
                     positions >= starts[b] are hidden but must be finite (a hidden row still enters the value
                     sum with weight 0, and 0 * NaN is NaN). Any Sequence: each layer's rows are read once,
                     when that layer runs, so the engine gathers them from its pages one layer at a time.
    """

    anchors: Tensor
    starts: Tensor
    num_drafts: tuple[int, ...]
    context: Sequence[Tensor]
    context_len: int

    def __post_init__(self) -> None:
        n = len(self.num_drafts)
        if n == 0 or self.anchors.shape != (n,) or self.starts.shape != (n,):
            raise ValueError(
                f"BlockBatch needs one anchor and one start per block: {n} num_drafts, anchors "
                f"{tuple(self.anchors.shape)}, starts {tuple(self.starts.shape)}"
            )

    def visibility(self) -> Tensor:
        """[B, 1, context_len + k_max] bool: what every query of block b sees (the block is bidirectional, so
        one row serves all its slots): context rows before its anchor and its own real slots, not padding."""
        device = self.starts.device
        context = torch.arange(self.context_len, device=device) < self.starts[:, None]
        slots = torch.ones(len(self.num_drafts), max(self.num_drafts), dtype=torch.bool, device=device)
        for b, k in enumerate(self.num_drafts):
            slots[b, k:] = False  # a host slice per shorter block: no device copy of num_drafts needed
        return torch.cat([context, slots], dim=1)[:, None, :]


# --- sampling helpers (the draft distribution q) -------------------------------------------------------


def draft_distribution(
    logits: Tensor, temperature: float, top_k: int | None = None, top_p: float | None = None,
    min_p: float | None = None,
) -> tuple[Tensor, Tensor]:
    """(processed logits, q) for logits [..., V]: divide by the temperature, then drop what the target's
    sampler drops (kernels/sampling_masks.py, in its order: top-k, top-p, min-p; ties at a boundary kept);
    dropped tokens get -inf. Computed in at least fp32; finite logits stay finite at any temperature
    (kernels/temperature.py)."""
    if not temperature > 0:
        raise ValueError(f"temperature={temperature}: a sampled draft needs temperature > 0 (0 means greedy)")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k={top_k} must be >= 1 (or None for no top-k)")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p} must be in (0, 1] (or None for no top-p)")
    if min_p is not None and not 0 <= min_p <= 1:
        raise ValueError(f"min_p={min_p} must be in [0, 1] (or None for no min-p)")
    z = scale_by_temperature_finite(at_least_fp32(logits), temperature)
    rows = z.shape[:-1]
    if top_k is not None:
        z = z.masked_fill(top_k_mask(z, z.new_full(rows, top_k, dtype=torch.long), top_k), float("-inf"))
    if top_p is not None and top_p < 1:
        z = z.masked_fill(top_p_mask(z, z.new_full(rows, top_p)), float("-inf"))
    if min_p:
        z = z.masked_fill(min_p_mask(z, z.new_full(rows, min_p)), float("-inf"))
    return z, z.softmax(dim=-1)


def one_hot_probs(tokens: Tensor, vocab_size: int, dtype: torch.dtype) -> Tensor:
    """The greedy draft's distribution: a point mass on each chosen token."""
    return F.one_hot(tokens, vocab_size).to(dtype)


# --- the layers -----------------------------------------------------------------------------------------


class DSparkMLA(nn.Module):
    """DeepSeek-V3 MLA with yarn RoPE; attribute names match the checkpoint under `layers.{i}.self_attn.`.

    Per token x (already normed):
        q = q_b_proj(q_a_layernorm(q_a_proj(x))) = [q_nope | q_pe] per head        (q_proj(x) without q_lora)
        [c | k_pe] = kv_a_proj_with_mqa(x);  row = [kv_a_layernorm(c) | RoPE(k_pe)]   the cached latent row
        k_h = [W_UK,h c | k_pe_rot],  v_h = W_UV,h c                                   (W_UK, W_UV: kv_b_proj rows)
    Attention runs in the absorbed form over the latent rows (as the served MQA kernels do):
        q_abs,h = [W_UK,h^T q_nope,h | RoPE(q_pe,h)],  o_h = W_UV,h sum_s softmax_s(scale q_abs,h . row_s) c_s
    """

    def __init__(self, cfg: DSparkConfig):
        super().__init__()
        self.num_heads = h = cfg.num_attention_heads
        self.nope, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        self.q_lora_rank = cfg.q_lora_rank
        self.scale = cfg.softmax_scale
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(d, h * cfg.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(d, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, eps)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, h * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, cfg.kv_cache_width, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, eps)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, h * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(h * self.v_dim, d, bias=False)
        self.rotary = YarnRotaryEmbedding(cfg.rope, cfg.qk_rope_head_dim)

    def latent_rows(self, x: Tensor, positions: Tensor, norm: Norm = module_norm, rope: Rope | None = None) -> Tensor:
        """x [..., T, D] -> latent rows [..., T, kv_lora_rank + rope] = [kv_a_layernorm(c) | RoPE(k_pe, positions)]."""
        c, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        k_rot = self.rotate(k_pe, positions) if rope is None else rope(k_pe)
        return torch.cat([norm(self.kv_a_layernorm, c), k_rot], dim=-1)

    def queries(self, x: Tensor, positions: Tensor, norm: Norm = module_norm,
                rope: Rope | None = None) -> tuple[Tensor, Tensor]:
        """x [..., T, D] -> (q_nope [..., T, H, nope], q_pe [..., T, H, rope] rotated to its position)."""
        q = self.q_proj(x) if self.q_lora_rank is None else self.q_b_proj(norm(self.q_a_layernorm, self.q_a_proj(x)))
        q_nope, q_pe = q.unflatten(-1, (self.num_heads, -1)).split([self.nope, self.rope_dim], dim=-1)
        return q_nope, self.rotate(q_pe, positions) if rope is None else rope(q_pe)

    def rotate(self, x: Tensor, positions: Tensor) -> Tensor:
        """RoPE of x [..., T, *rest] at positions [..., T] (the rotary itself takes one flat row dimension)."""
        flat = positions.reshape(-1)
        return self.rotary(x.reshape(flat.shape[0], *x.shape[positions.dim() :]), flat).view(x.shape)

    def kv_b_weights(self) -> tuple[Tensor, Tensor]:
        """kv_b_proj per head: (W_UK [H, nope, kv_lora_rank], W_UV [H, v, kv_lora_rank])."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.kv_lora_rank)
        return w[:, : self.nope], w[:, self.nope :]

    def forward(self, x: Tensor, positions: Tensor, context_rows: Tensor, visible: Tensor | None = None) -> Tensor:
        """x [..., k, D] (the normed block) attends over context_rows [..., S, width] followed by its own k rows;
        leading dims are independent blocks (the engine drafts B of them at once).

        visible [..., k, S + k] or [..., 1, S + k] (bool, the 1 broadcast over the queries) says which of those
        rows each query sees; None: all of them. Returns [..., k, D]; the block's rows are not kept."""
        rows = torch.cat([context_rows, self.latent_rows(x, positions)], dim=-2)
        q_nope, q_pe = self.queries(x, positions)
        w_uk, w_uv = self.kv_b_weights()
        q_abs = torch.cat([torch.einsum("...thn,hnr->...thr", q_nope, w_uk), q_pe], dim=-1)
        scores = at_least_fp32(torch.einsum("...thc,...sc->...ths", q_abs, rows)) * self.scale
        if visible is not None:
            scores = scores.masked_fill(~visible[..., None, :], float("-inf"))
        p = scores.softmax(dim=-1).to(x.dtype)
        o_latent = torch.einsum("...ths,...sr->...thr", p, rows[..., : self.kv_lora_rank])
        o = torch.einsum("...thr,hvr->...thv", o_latent, w_uv)
        return self.o_proj(o.flatten(-2))


class DSparkMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)) (no hidden_act in the config: DeepseekV2Config's default silu)."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DSparkDecoderLayer(nn.Module):
    """Pre-norm residual block: x + MLA(RMSNorm(x)), then x + SwiGLU(RMSNorm(x))."""

    def __init__(self, cfg: DSparkConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DSparkMLA(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DSparkMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: Tensor, positions: Tensor, context_rows: Tensor, visible: Tensor | None = None) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, context_rows, visible)
        return x + self.mlp(self.post_attention_layernorm(x))


class MarkovHead(nn.Module):
    """The vanilla low-rank bigram bias B(x_prev, .) = W2 W1[x_prev] (W1: an embedding [V, r]; W2: Linear r -> V)."""

    def __init__(self, vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)

    def prev_embedding(self, prev_tokens: Tensor) -> Tensor:
        """W1[x_prev] [..., r]. Ids are clamped into the vocabulary first: a NaN logits row can make an argmax
        kernel return an out-of-range id (ROCm/ATOM PR #2151), and the gather must not fault on it."""
        return self.markov_w1(prev_tokens.clamp(0, self.markov_w1.num_embeddings - 1))

    def forward(self, prev_tokens: Tensor) -> Tensor:
        """prev_tokens [...] -> bias [..., V]."""
        return self.markov_w2(self.prev_embedding(prev_tokens))


class ConfidenceHead(nn.Module):
    """The logit of c = sigmoid(proj(features)), features = [h ; W1[x_prev]] (or h alone without
    confidence_head_with_markov). It returns the logit, not c: training's BCE takes logits, which stay exact
    where the sigmoid saturates."""

    def __init__(self, input_size: int):
        super().__init__()
        self.proj = nn.Linear(input_size, 1)

    def forward(self, features: Tensor) -> Tensor:
        return at_least_fp32(self.proj(features)).squeeze(-1)


# --- the draft -------------------------------------------------------------------------------------------


class K3DSparkModel(nn.Module):
    """The DSpark draft; `state_dict()` names equal the checkpoint's (less `embed_tokens.weight`)."""

    def __init__(self, cfg: DSparkConfig):
        super().__init__()
        self.config = cfg
        self.context_proj = nn.Linear(cfg.context_input_size, cfg.hidden_size, bias=False)
        self.context_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DSparkDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.markov_head = MarkovHead(cfg.draft_vocab_size, cfg.markov_rank)
        self.confidence_head = ConfidenceHead(cfg.confidence_input_size) if cfg.enable_confidence_head else None

    @classmethod
    def from_checkpoint(cls, path: str | Path, dtype: torch.dtype = torch.float32) -> K3DSparkModel:
        """Build on the meta device and take the checkpoint's tensors (strict: every name, no extras)."""
        cfg, tensors = load_dspark_checkpoint(path, dtype=dtype)
        with torch.device("meta"):
            model = cls(cfg)
        model.load_state_dict(tensors, strict=True, assign=True)
        return model.eval()

    @property
    def dtype(self) -> torch.dtype:
        return self.context_proj.weight.dtype

    def new_cache(self) -> DraftCache:
        return DraftCache.empty(self.config, dtype=self.dtype, device=self.context_proj.weight.device)

    # --- context -------------------------------------------------------------------------------------
    @torch.no_grad()
    def context_kv(self, taps: Tensor, positions: Tensor, norm: Norm = module_norm,
                   rope: Rope | None = None) -> list[Tensor]:
        """Target taps [T, m * D_target] at positions [T] -> per-layer latent rows [T, width] (`context_rows`
        without autograd, as inference runs it)."""
        return self.context_rows(taps, positions, norm, rope)

    def context_rows(self, taps: Tensor, positions: Tensor, norm: Norm = module_norm,
                     rope: Rope | None = None) -> list[Tensor]:
        """The differentiable context path: taps [T, m * D_target] at positions [T] -> per-layer rows [T, width].

        H_ctx = context_norm(context_proj(taps)) is shared by every layer, and each layer projects it with its
        own kv_a_proj_with_mqa, skipping its input_layernorm (DS-code Qwen3DSparkAttention; vLLM dspark_mla.py
        `precompute_and_store_context_kv`)."""
        cfg = self.config
        if taps.dim() != 2 or taps.shape[1] != cfg.context_input_size:
            raise ValueError(
                f"taps must be [T, {cfg.context_input_size}] (the raw streams of target layers "
                f"{list(cfg.target_layer_ids)} concatenated, {cfg.target_hidden_size} each); got {tuple(taps.shape)}"
            )
        if positions.dim() != 1 or positions.shape[0] != taps.shape[0]:
            raise ValueError(f"positions must be [T] with T = {taps.shape[0]}; got shape {tuple(positions.shape)}")
        if taps.dtype != self.dtype:
            raise ValueError(f"taps are {taps.dtype} but the draft runs in {self.dtype}; cast them first")
        h_ctx = norm(self.context_norm, self.context_proj(taps))
        return [layer.self_attn.latent_rows(h_ctx, positions, norm, rope) for layer in self.layers]

    def extend_context(self, cache: DraftCache, taps: Tensor) -> None:
        """Append the rows of the next T context tokens (positions len(cache) ..) to `cache`."""
        start = cache.num_tokens
        positions = torch.arange(start, start + taps.shape[0], device=taps.device)
        cache.append(self.context_kv(taps, positions))

    # --- the blocks ----------------------------------------------------------------------------------
    def check_block(self, anchor_token: int, anchor_pos: int, num_drafts: int, context_len: int) -> None:
        """Host-side checks of one block's arguments (plain ints: nothing is read back from the device)."""
        cfg = self.config
        if num_drafts < 1:
            raise ValueError(f"num_drafts={num_drafts} must be >= 1")
        if not 0 <= anchor_token < cfg.vocab_size:
            raise ValueError(f"anchor_token={anchor_token} is outside the vocabulary 0..{cfg.vocab_size - 1}")
        if not 0 <= anchor_pos <= context_len:
            raise ValueError(
                f"anchor_pos={anchor_pos} needs context rows for positions 0..{anchor_pos - 1}, but the cache holds "
                f"{context_len}; feed the target taps of every token before the anchor first"
            )

    def cache_block(self, cache: DraftCache, anchor_token: int, anchor_pos: int, num_drafts: int) -> BlockBatch:
        """One request's block as a batch of one. Context rows at positions >= anchor_pos (rows of rejected
        tokens not yet trimmed) are left out."""
        self.check_block(anchor_token, anchor_pos, num_drafts, cache.num_tokens)
        device = self.context_proj.weight.device
        return BlockBatch(
            anchors=torch.tensor([anchor_token], device=device),
            starts=torch.tensor([anchor_pos], device=device),
            num_drafts=(num_drafts,),
            context=[rows[None, :anchor_pos] for rows in cache.rows],
            context_len=anchor_pos,
        )

    @torch.no_grad()
    def block_hidden(
        self, cache: DraftCache, anchor_token: int, anchor_pos: int, num_drafts: int, embed: Embed
    ) -> Tensor:
        """Final-normed hidden states h [k, D] of one block [anchor, mask x (k - 1)] at positions anchor_pos + j."""
        return self.blocks_hidden(self.cache_block(cache, anchor_token, anchor_pos, num_drafts), embed)[0]

    @torch.no_grad()
    def blocks_hidden(self, blocks: BlockBatch, embed: Embed) -> Tensor:
        """Final-normed hidden states h [B, k_max, D] of B blocks in one forward. Slots at or past a block's
        num_drafts are padding: they run, but no real slot sees them, and the caller drops them."""
        k_max = max(blocks.num_drafts)
        positions = blocks.starts[:, None] + torch.arange(k_max, device=blocks.starts.device)
        return self.block_forward(self.block_inputs(blocks.anchors, k_max, embed), positions, blocks.context,
                                  blocks.visibility())

    def block_inputs(self, anchors: Tensor, k_max: int, embed: Embed) -> Tensor:
        """The embedded inputs [B, k_max, D] of B blocks [anchor, mask x (k_max - 1)]."""
        cfg = self.config
        n = anchors.shape[0]
        slots = torch.arange(k_max, device=anchors.device)
        x = embed(torch.where(slots == 0, anchors[:, None], cfg.mask_token_id).flatten())
        if x.shape != (n * k_max, cfg.hidden_size) or x.dtype != self.dtype:
            raise ValueError(
                f"embed returned {tuple(x.shape)} {x.dtype}; expected [{n * k_max}, {cfg.hidden_size}] {self.dtype} "
                "(pass the target's embed_tokens in the draft's dtype)"
            )
        return x.view(n, k_max, -1)

    def block_forward(
        self, x: Tensor, positions: Tensor, context_rows: Sequence[Tensor], visible: Tensor | None = None
    ) -> Tensor:
        """The differentiable block stack: embedded block inputs x [..., k, D] at positions [..., k] -> final-normed
        h [..., k, D] (leading dims: independent blocks).

        context_rows: per draft layer, the [..., S, width] rows the queries may attend to, read once, when that
        layer runs; visible: the optional mask of `DSparkMLA.forward` (None: every context row and block slot)."""
        for layer, rows in zip(self.layers, context_rows, strict=True):
            x = layer(x, positions, rows, visible)
        return self.final_norm(x)

    @torch.no_grad()
    def propose(
        self,
        cache: DraftCache,
        anchor_token: int,
        anchor_pos: int,
        num_drafts: int,
        embed: Embed,
        lm_head: LMHead,
        *,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        min_p: float | None = None,
        generator: torch.Generator | None = None,
    ) -> DraftProposal:
        """Draft `num_drafts` tokens after `anchor_token` (at `anchor_pos`); `cache` is read, never written.

        temperature 0: greedy, x_j = argmax(U_j + W2 W1[x_{j-1}]). temperature > 0: x_j ~ q_j =
        softmax((U_j + W2 W1[x_{j-1}]) / T), optionally top-k, top-p and min-p filtered (as the target's sampler would;
        the verifier must use exactly these q_j). `generator` drives the draws (torch.multinomial)."""
        block = self.cache_block(cache, anchor_token, anchor_pos, num_drafts)
        sampling = DraftSampling(temperature, top_k, top_p, min_p, generator)
        return self.propose_blocks(block, embed, lm_head, [sampling])[0]

    @torch.no_grad()
    def propose_blocks(
        self, blocks: BlockBatch, embed: Embed, lm_head: LMHead, sampling: Sequence[DraftSampling]
    ) -> list[DraftProposal]:
        """Draft every block of `blocks` (block b drawn as sampling[b] says, see `propose`) with one forward and
        one lm_head GEMM for all of them; each proposal equals the one its block would get alone."""
        if len(sampling) != len(blocks.num_drafts):
            raise ValueError(f"propose_blocks got {len(sampling)} sampling settings for {len(blocks.num_drafts)} "
                             "blocks")
        return self.propose_from_hidden(self.blocks_hidden(blocks, embed), blocks.anchors, blocks.num_drafts,
                                        lm_head, sampling)

    @torch.no_grad()
    def propose_from_hidden(
        self, hidden: Tensor, anchors: Tensor, num_drafts: Sequence[int], lm_head: LMHead,
        sampling: Sequence[DraftSampling], chain: GreedyChain | None = None,
    ) -> list[DraftProposal]:
        """The blocks' proposals from their final-normed hidden states [B, k_max, D] (`blocks_hidden`, or the
        paged GPU path of models/dspark/paged.py): one lm_head GEMM, then the Markov stage (greedy blocks through
        `chain` when given)."""
        n, k_max = len(num_drafts), max(num_drafts)
        base_logits = lm_head(hidden.flatten(0, 1))  # padding slots ride along: the GEMM's cost is the weight
        vocab = self.config.draft_vocab_size
        if base_logits.shape != (n * k_max, vocab):
            raise ValueError(f"lm_head returned {tuple(base_logits.shape)}; expected [{n * k_max}, {vocab}]")
        base_logits = base_logits.view(n, k_max, vocab)
        tokens, drawn = self.markov_blocks(base_logits, anchors, num_drafts, sampling, chain)
        return [DraftProposal(tokens=tokens[b, :k], probs=probs) for b, (k, probs) in
                enumerate(zip(num_drafts, drawn, strict=True))]

    def markov_blocks(
        self, base_logits: Tensor, anchors: Tensor, num_drafts: Sequence[int], sampling: Sequence[DraftSampling],
        chain: GreedyChain | None = None,
    ) -> tuple[Tensor, list[Tensor]]:
        """The Markov stage of B blocks: (tokens [B, k_max], per block q [k, V]).

        Greedy blocks run as one batch: all B rows go through one argmax chain (`markov_sample`, or `chain`),
        which costs no more than picking the greedy rows out, and a sampled block's row of it is overwritten. A
        sampled block runs alone, so its generator makes exactly the calls it made when that block was drafted
        by itself."""
        greedy = [s.temperature == 0 for s in sampling]
        if any(greedy) and chain is not None:
            tokens = chain(base_logits, anchors)
            probs = one_hot_probs(tokens, self.config.draft_vocab_size,
                                  torch.promote_types(base_logits.dtype, torch.float32))
        elif any(greedy):
            tokens, _, probs = self.markov_sample(base_logits, anchors)
        else:
            tokens = anchors.new_zeros(base_logits.shape[:2])
        drawn = []
        for b, (k, s) in enumerate(zip(num_drafts, sampling, strict=True)):
            if greedy[b]:
                drawn.append(probs[b, :k])
                continue
            block_tokens, _, block_probs = self.markov_sample(
                base_logits[b, :k], anchors[b], temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                min_p=s.min_p, generator=s.generator,
            )
            tokens[b, :k] = block_tokens
            drawn.append(block_probs)
        return tokens, drawn

    @torch.no_grad()
    def markov_sample(
        self,
        base_logits: Tensor,
        anchor_tokens: int | Tensor,
        *,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        min_p: float | None = None,
        generator: torch.Generator | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """The sequential stage: base logits U [..., k, V] -> (tokens [..., k], logits [..., k, V], q [..., k, V]),
        left to right, slot j conditioned on x_{j-1} (x_0 = the anchor, anchor_tokens [...]). The logits are
        U_j + W2 W1[x_{j-1}], divided by T and masked when sampled (q their softmax, see `DraftProposal`).
        Greedy chains may be batched (leading dims); a sampled one is one block ([k, V]), since its draws come
        from the generator of one request."""
        if temperature < 0:
            raise ValueError(f"temperature={temperature} must be >= 0 (0 means greedy)")
        if temperature > 0 and base_logits.dim() != 2:
            raise ValueError(
                f"a sampled draft is one block: base_logits must be [k, V]; got {tuple(base_logits.shape)}"
            )
        vocab = self.config.draft_vocab_size
        prev = torch.as_tensor(anchor_tokens, device=base_logits.device)
        tokens, logits, probs = [], [], []
        for j in range(base_logits.shape[-2]):  # sequential: slot j's bias depends on the token drawn at j - 1
            corrected = self.markov_logits(base_logits[..., j, :], prev)
            if temperature == 0:
                token = corrected.argmax(dim=-1)
                row_logits, row_probs = corrected, one_hot_probs(token.clamp(0, vocab - 1), vocab, corrected.dtype)
            else:
                row_logits, row_probs = draft_distribution(corrected, temperature, top_k, top_p, min_p)
                # Draft numbers gone bad (NaN context rows) must not fail the step for every request: the
                # slot proposes its argmax with q one-hot, still the distribution the draft was drawn from,
                # so verification stays exact; only this request's acceptance suffers (and NaN target
                # logits end the request alone in the engine).
                bad = ~torch.isfinite(row_probs).all(dim=-1, keepdim=True)
                point = one_hot_probs(corrected.argmax(dim=-1).clamp(0, vocab - 1), vocab, row_probs.dtype)
                row_probs = torch.where(bad, point, row_probs)
                row_logits = torch.where(bad, point.log(), row_logits)
                token = torch.multinomial(row_probs, 1, generator=generator)[0]
            prev = token.clamp(0, vocab - 1)  # an out-of-range id must never reach the W1 gather
            tokens.append(prev)
            logits.append(row_logits)
            probs.append(row_probs)
        return torch.stack(tokens, dim=-1), torch.stack(logits, dim=-2), torch.stack(probs, dim=-2)

    def markov_logits(self, base_logits: Tensor, prev_tokens: Tensor) -> Tensor:
        """U_j + W2 W1[prev_j] for all slots at once (prev_tokens [k] = [x_0 = anchor, x_1 .. x_{k-1}])."""
        return at_least_fp32(base_logits) + at_least_fp32(self.markov_head(prev_tokens))

    def confidence(self, hidden: Tensor, prev_tokens: Tensor) -> Tensor | None:
        """c_j = sigmoid(w . [h_j ; W1[x_{j-1}]] + b), or None without a confidence head."""
        logits = self.confidence_logits(hidden, prev_tokens)
        return None if logits is None else torch.sigmoid(logits)

    def confidence_logits(self, hidden: Tensor, prev_tokens: Tensor) -> Tensor | None:
        """w . [h_j ; W1[x_{j-1}]] + b (the logit of c_j) for hidden [..., D] and prev_tokens [...], or None."""
        if self.confidence_head is None:
            return None
        features = hidden
        if self.config.confidence_head_with_markov:
            features = torch.cat([hidden, self.markov_head.prev_embedding(prev_tokens)], dim=-1)
        return self.confidence_head(features)
