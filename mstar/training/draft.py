"""Train a DSpark draft (K3DSparkModel) on a frozen Kimi K3 target, on the Python standard library.

    python -m mstar.training.draft TARGET_DIR OUT_DIR [--steps N] [--device cpu|cuda]
        [--train-data CONTINUATIONS_FILE] [--init DRAFT_DIR]

writes OUT_DIR/ as a draft checkpoint (config.json + safetensors in the Inferact layout) and OUT_DIR/training.json
(config, loss history, timing, acceptance before and after training, and the served acceptance's learning curve).

Each step takes `batch` windows of the train stream, or with `--train-data` `batch` sequences of the target's own
continuations of training-stream prompts (mstar/training/continuations.py: self-distillation, the text the draft
sees when served), anchors then drawn in the continuation part only. The target runs each window once (no grad),
giving the taps the draft's context reads and its next-token distributions p_t. `anchors` random positions per
window each start a block [anchor, mask x 6] at positions a .. a + 6, and all blocks of a window run in one masked
attention: a block's queries see the context rows below its anchor and the 7 slots of their own block, exactly what
inference shows one block (DSpark "anchor as first prediction": slot k predicts the token at a + k + 1, matched to
the target's softmax at a + k). The loss (DSpark paper eqs. 9-12; research notes dspark.md 1.2, 1.4):

    0.1 CE + 0.9 sum_k exp(-k/4) ||p_d,k - p_t,k||_1 + 1.0 BCE(c_k, c*_k),   c*_k = 1 - ||p_d,k - p_t,k||_1 / 2

with the Markov head teacher-forced on the true previous token (x_0 = the anchor). The target's embedding and
lm_head are frozen and shared: the draft has none of its own.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from mstar.models.dspark.config import parse_dspark_config
from mstar.models.dspark.model import K3DSparkModel
from mstar.models.dspark.weights import EMBED_TOKENS, random_dspark_tensors, save_dspark_checkpoint
from mstar.models.kimi_k3.config import KimiK3Config
from mstar.models.kimi_k3.model import KimiK3ForCausalLM
from mstar.models.kimi_k3.norm import at_least_fp32
from mstar.models.kimi_k3.tokenizer import NUM_SPECIAL_SLOTS, KimiTokenizer
from mstar.models.kimi_k3.weights import load_model
from mstar.tools.make_tiny import tiny_dspark_raw_config
from mstar.training.continuations import Continuations, generate
from mstar.training.corpus import build_corpus, fixed_windows, random_windows
from mstar.training.served_engine import NEW_TOKENS, engine_acceptance
from mstar.training.target import TrainConfig, lr_at, make_optimizer, use_training_chunks

BLOCK_SIZE = 7  # anchor + 6 masks -> 7 drafts, as Kimi-K3-DSpark is deployed (num_speculative_tokens 7)
CE_WEIGHT, L1_WEIGHT, CONFIDENCE_WEIGHT = 0.1, 0.9, 1.0
L1_DECAY = 4.0  # w_k = exp(-k / 4) for 0-based slot k (DeepSpec loss_decay_gamma=4): early slots matter most
NUM_DRAFT_LAYERS = 2
NUM_TAPS = 3
MARKOV_RANK = 64
LOG_EVERY = 25


# --- the draft's config ------------------------------------------------------------------------------------


def spread_taps(num_layers: int) -> list[int]:
    """NUM_TAPS target layers evenly spread from layer 1 to the last but one (the last layer is never tapped)."""
    span = num_layers - 3  # layers 1 .. num_layers - 2
    if span < NUM_TAPS - 1:
        raise ValueError(
            f"a target with {num_layers} layers has too few tappable layers (1..{num_layers - 2}) "
            f"for {NUM_TAPS} distinct taps"
        )
    steps = NUM_TAPS - 1
    return [1 + (2 * i * span + steps) // (2 * steps) for i in range(NUM_TAPS)]  # 1 + i * span / steps, rounded


def mini_dspark_raw_config(target: KimiK3Config) -> dict:
    """The draft config.json for `target`: make_tiny's draft (TINY_MLA geometry, K3's special-token layout,
    the fixture's yarn RoPE) with 2 layers, a 2x hidden SwiGLU, Markov rank 64 and 3 spread taps, in fp32."""
    raw = tiny_dspark_raw_config(target, num_ranks=target.vocab_size - NUM_SPECIAL_SLOTS)
    taps = spread_taps(target.num_hidden_layers)
    raw.update(
        num_hidden_layers=NUM_DRAFT_LAYERS,
        intermediate_size=2 * target.hidden_size,
        markov_rank=MARKOV_RANK,
        num_target_layers=len(taps),
        target_layer_ids=taps,
        torch_dtype="float32",
    )
    return raw


def new_draft(raw_config: dict, seed: int, device: torch.device | str = "cpu") -> K3DSparkModel:
    """A freshly initialised fp32 draft (make_tiny's well-scaled random weights)."""
    cfg = parse_dspark_config(raw_config)
    model = K3DSparkModel(cfg)
    gen = torch.Generator().manual_seed(seed)
    model.load_state_dict(random_dspark_tensors(cfg, gen, torch.float32, include_embed_tokens=False))
    return model.to(device)


def frozen_target(target_dir: Path, device: torch.device | str = "cpu") -> KimiK3ForCausalLM:
    """The target in fp32 with no gradients. Its forward dominates a step, so KDA runs in the chunk size the
    target's own training uses (the same math, faster on CPU)."""
    target = load_model(target_dir, dtype=torch.float32, device=device).eval().requires_grad_(False)
    use_training_chunks(target)
    return target


# --- the batched, differentiable block forward ---------------------------------------------------------------


def slot_positions(anchors: Tensor) -> Tensor:
    """[N, BLOCK_SIZE]: slot k of the block anchored at a sits at position a + k."""
    return anchors[:, None] + torch.arange(BLOCK_SIZE, device=anchors.device)


def block_visibility(anchors: Tensor, context_len: int) -> Tensor:
    """[N * B, context_len + N * B] bool: the query of block n sees context rows at positions < anchors[n] and
    the B slots of block n (bidirectional), nothing of the other blocks."""
    block_of = torch.arange(anchors.numel(), device=anchors.device).repeat_interleave(BLOCK_SIZE)
    context = torch.arange(context_len, device=anchors.device)[None, :] < anchors[block_of][:, None]
    own_block = block_of[:, None] == block_of[None, :]
    return torch.cat([context, own_block], dim=1)


@dataclass
class DraftBlocks:
    """The blocks anchored at N positions of one window, teacher-forced; every tensor is [N, BLOCK_SIZE, ...]."""

    hidden: Tensor  # h_k, final-normed
    base_logits: Tensor  # U_k = lm_head(h_k)
    logits: Tensor  # U_k + W2 W1[x_{k-1}], x_{k-1} the true previous token
    prev_tokens: Tensor  # x_{k-1}: the anchor, then the window's tokens
    labels: Tensor  # the token slot k predicts, at a + k + 1


def draft_blocks(
    model: K3DSparkModel, target: KimiK3ForCausalLM, ids: Tensor, taps: Tensor, anchors: Tensor
) -> DraftBlocks:
    """All blocks of window `ids` [L] (target taps [L, m * D]) anchored at `anchors` [N], in one forward."""
    cfg, n, length = model.config, anchors.numel(), ids.numel()
    if anchors.min() < 0 or anchors.max() + BLOCK_SIZE >= length:
        raise ValueError(
            f"anchors must lie in 0..{length - BLOCK_SIZE - 1}: each needs {BLOCK_SIZE} labels "
            f"inside the {length}-token window"
        )
    positions = slot_positions(anchors)
    block_ids = torch.full((n, BLOCK_SIZE), cfg.mask_token_id, dtype=torch.long, device=ids.device)
    block_ids[:, 0] = ids[anchors]
    context_rows = model.context_rows(taps, torch.arange(length, device=ids.device))
    x = target.model.embed_tokens(block_ids.reshape(-1))
    hidden = model.block_forward(x, positions.reshape(-1), context_rows, block_visibility(anchors, length))
    hidden = hidden.view(n, BLOCK_SIZE, -1)
    base_logits = target.lm_head(hidden)
    prev_tokens = ids[positions]
    return DraftBlocks(
        hidden=hidden,
        base_logits=base_logits,
        logits=model.markov_logits(base_logits, prev_tokens),
        prev_tokens=prev_tokens,
        labels=ids[positions + 1],
    )


def dspark_loss(model: K3DSparkModel, blocks: DraftBlocks, target_logits: Tensor) -> tuple[Tensor, dict[str, float]]:
    """The DSpark loss of `blocks` against the target's logits at each slot's position ([N, B, V]).

    CE and BCE are means over all slots; the decayed L1 is summed over the slots of a block, then averaged over
    blocks (eq. 10's sum over k)."""
    p_t = at_least_fp32(target_logits).softmax(dim=-1)
    l1 = (blocks.logits.softmax(dim=-1) - p_t).abs().sum(dim=-1)  # [N, B], in [0, 2]
    decay = torch.exp(-torch.arange(BLOCK_SIZE, device=l1.device, dtype=l1.dtype) / L1_DECAY)
    ce = F.cross_entropy(blocks.logits.flatten(0, 1), blocks.labels.flatten())
    l1_term = (l1 * decay).sum(dim=-1).mean()
    loss = CE_WEIGHT * ce + L1_WEIGHT * l1_term
    parts = {"ce": ce, "l1": l1_term}
    confidence_logits = model.confidence_logits(blocks.hidden, blocks.prev_tokens)
    if confidence_logits is not None:
        # c* is the probability that a draft from p_d survives verification against p_t; a target, not a path
        # for gradients into the draft distribution. Clamped: float error can push 1 - l1/2 just below 0.
        survival = (1 - 0.5 * l1.detach()).clamp(0, 1)
        parts["bce"] = F.binary_cross_entropy_with_logits(confidence_logits, survival)
        loss = loss + CONFIDENCE_WEIGHT * parts["bce"]
    parts["loss"] = loss
    return loss, {name: float(v.detach()) for name, v in parts.items()}


class TargetPass:
    """The frozen target's taps and logits on a window. With `keep`, they are computed once per sequence and kept:
    the target's continuations are a fixed set of sequences, visited again and again, and the target's forward is
    most of a step's cost. Sequences are told apart by their storage (they live as long as the training data)."""

    def __init__(self, target: KimiK3ForCausalLM, taps: tuple[int, ...], keep: bool):
        self.target, self.taps, self.keep = target, taps, keep
        self.kept: dict[tuple[int, int], tuple[Tensor, Tensor]] = {}

    def __call__(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        key = (ids.data_ptr(), ids.numel())
        if key in self.kept:
            return self.kept[key]
        with torch.no_grad():
            out = self.target(ids, tap_layers=self.taps)
        if self.keep:
            self.kept[key] = (out.taps, out.logits)
        return out.taps, out.logits


def window_loss(
    model: K3DSparkModel, target: KimiK3ForCausalLM, ids: Tensor, anchors: Tensor, target_pass: TargetPass | None = None
) -> tuple[Tensor, dict[str, float]]:
    target_pass = target_pass or TargetPass(target, model.config.target_layer_ids, keep=False)
    taps, logits = target_pass(ids)
    blocks = draft_blocks(model, target, ids, taps, anchors)
    return dspark_loss(model, blocks, logits[slot_positions(anchors)])


# --- training ---------------------------------------------------------------------------------------------


@dataclass
class DraftTrainConfig(TrainConfig):
    """`batch` is windows per step, `seq_len` the window length; `anchors` blocks are drawn per window."""

    steps: int = 1000
    batch: int = 4
    lr: float = 2e-3
    warmup: int = 50
    weight_decay: float = 0.01
    eval_windows: int = 16
    anchors: int = 64
    eval_anchor_stride: int = 4  # held-out blocks start at every 4th position of each window
    grad_clip: float = 1.0
    served_eval_every: int = 100  # steps between points of the served acceptance's learning curve

    def __post_init__(self) -> None:
        room = self.seq_len - BLOCK_SIZE - 1  # anchors 1 .. seq_len - 8: some context, and 7 labels in the window
        if not 1 <= self.anchors <= room:
            raise ValueError(f"anchors={self.anchors} must be in 1..{room} for windows of seq_len={self.seq_len}")


Batch = list[tuple[Tensor, Tensor]]  # (window ids [L], anchors [N]) per window


def random_anchors(length: int, count: int, gen: torch.Generator, first: int = 1) -> Tensor:
    """`count` distinct anchors in first .. length - BLOCK_SIZE - 1 (sorted; fewer where fewer fit)."""
    return (torch.randperm(length - BLOCK_SIZE - first, generator=gen)[:count] + first).sort().values


def blocks_fit(data: Continuations) -> list[int]:
    """The sequences whose continuation holds a whole block after an anchor (the target may stop a continuation
    after a few tokens)."""
    usable = [i for i, (ids, start) in enumerate(zip(data.sequences, data.prompt_lens, strict=True))
              if ids.numel() - BLOCK_SIZE - start >= 1]
    if not usable:
        raise ValueError(f"no continuation is longer than a block ({BLOCK_SIZE} tokens after its anchor): "
                         "generate longer ones (python -m mstar.training.continuations --seq-len)")
    return usable


def sample_batch(data: Tensor | Continuations, cfg: DraftTrainConfig, gen: torch.Generator,
                 device: torch.device) -> Batch:
    """`cfg.batch` random windows of a token stream (anchors anywhere past the first token), or random sequences of
    the target's continuations (anchors from the first continuation token on: the anchor of a served block is a
    token the target chose)."""
    if isinstance(data, Tensor):
        windows = random_windows(data, cfg.seq_len, cfg.batch, gen)
        return [(w.to(device), random_anchors(cfg.seq_len, cfg.anchors, gen).to(device)) for w in windows]
    usable = blocks_fit(data)
    picks = [usable[j] for j in torch.randint(0, len(usable), (cfg.batch,), generator=gen).tolist()]
    return [
        (data.sequences[i].to(device),
         random_anchors(data.sequences[i].numel(), cfg.anchors, gen, first=data.prompt_lens[i]).to(device))
        for i in picks
    ]


def train_step(
    model: K3DSparkModel, target: KimiK3ForCausalLM, batch: Batch, opt: torch.optim.Optimizer, grad_clip: float,
    target_pass: TargetPass | None = None,
) -> dict[str, float]:
    """One optimizer step on `batch` (windows one after another, gradients accumulated); returns the mean loss
    parts before the update."""
    opt.zero_grad(set_to_none=True)
    totals: dict[str, float] = {}
    for ids, anchors in batch:
        loss, parts = window_loss(model, target, ids, anchors, target_pass)
        (loss / len(batch)).backward()
        for name, v in parts.items():
            totals[name] = totals.get(name, 0.0) + v / len(batch)
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    opt.step()
    return totals


def train(
    model: K3DSparkModel,
    target: KimiK3ForCausalLM,
    data: Tensor | Continuations,
    cfg: DraftTrainConfig,
    device: torch.device,
    served: ServedAcceptance | None = None,
    log=print,
) -> tuple[list[dict], list[dict]]:
    """Returns the loss history and the learning curve: the served acceptance (`served`) every
    `cfg.served_eval_every` steps and after the last, with the tokens seen so far."""
    gen = torch.Generator().manual_seed(cfg.seed)
    target_pass = TargetPass(target, model.config.target_layer_ids, keep=isinstance(data, Continuations))
    opt = make_optimizer(model, cfg)
    model.train()
    history, curve = [], []
    start, tokens = time.monotonic(), 0
    for step in range(cfg.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        batch = sample_batch(data, cfg, gen, device)
        parts = train_step(model, target, batch, opt, cfg.grad_clip, target_pass)
        tokens += sum(ids.numel() for ids, _ in batch)
        if served is not None and ((step + 1) % cfg.served_eval_every == 0 or step == cfg.steps - 1):
            report = served.evaluate(model.eval())
            model.train()
            curve.append(dict(step=step + 1, tokens=tokens, mean_accepted_length=report["mean_accepted_length"],
                              acceptance_per_position=report["acceptance_per_position"]))
            log(f"step {step + 1:5d}: served {format_acceptance(report)}")
        if step % LOG_EVERY == 0 or step == cfg.steps - 1:
            elapsed = time.monotonic() - start
            tok_s = tokens / elapsed  # window tokens through target and draft
            history.append(
                dict(
                    step=step,
                    **{k: round(v, 4) for k, v in parts.items()},
                    lr=lr_at(step, cfg),
                    seconds=round(elapsed, 1),
                    tokens=tokens,
                    tokens_per_s=round(tok_s, 1),
                )
            )
            terms = ", ".join(f"{name} {v:.3f}" for name, v in parts.items() if name != "loss")
            log(
                f"step {step:5d}/{cfg.steps}  loss {parts['loss']:.4f} ({terms})  lr {lr_at(step, cfg):.2e}  "
                f"{tok_s:,.0f} tok/s  {elapsed / 60:.1f} min"
            )
    model.eval()
    return history, curve


# --- offline acceptance -------------------------------------------------------------------------------------


def greedy_drafts(model: K3DSparkModel, base_logits: Tensor, anchor_tokens: Tensor) -> Tensor:
    """Greedy blocks as inference drafts them, batched: base logits [N, B, V] -> tokens [N, B], slot k's Markov
    bias taken from the draft's own choice at k - 1 (the anchor for k = 0)."""
    prev, tokens = anchor_tokens, []
    for k in range(base_logits.shape[1]):  # sequential: each slot's bias depends on the previous choice
        prev = model.markov_logits(base_logits[:, k], prev).argmax(dim=-1)
        tokens.append(prev)
    return torch.stack(tokens, dim=1)


@torch.no_grad()
def evaluate(model: K3DSparkModel, target: KimiK3ForCausalLM, windows: Tensor, stride: int) -> dict:
    """Offline greedy acceptance and the teacher-forced loss on held-out `windows` [W, L].

    At every `stride`-th anchor the greedy draft block is compared with the target's greedy tokens given the true
    prefix: a draft counts as accepted while it and every draft before it equal the target's argmax at its
    position. This stands in for running the target on the drafts (which would condition it on the draft tokens
    rather than the true ones); where every draft so far matched, the two differ only if the true text left the
    target's greedy path."""
    length = windows.shape[1]
    anchors = torch.arange(1, length - BLOCK_SIZE, stride, device=windows.device)
    positions = slot_positions(anchors)
    matched, confidence, totals = [], [], {}
    for ids in windows:
        out = target(ids, tap_layers=model.config.target_layer_ids)
        blocks = draft_blocks(model, target, ids, out.taps, anchors)
        _, parts = dspark_loss(model, blocks, out.logits[positions])
        for name, v in parts.items():
            totals[name] = totals.get(name, 0.0) + v / len(windows)
        drafts = greedy_drafts(model, blocks.base_logits, ids[anchors])
        matched.append((drafts == out.logits[positions].argmax(dim=-1)).long().cumprod(dim=1))
        conf = model.confidence(blocks.hidden, torch.cat([ids[anchors, None], drafts[:, :-1]], dim=1))
        if conf is not None:
            confidence.append(conf)
    return acceptance_report(torch.cat(matched), torch.cat(confidence) if confidence else None, totals)


def acceptance_report(matched: Tensor, confidence: Tensor | None, held_out_loss: dict[str, float]) -> dict:
    """matched [N, B]: 1 where a block's drafts 1..k+1 all match. Rates per 0-based slot k."""
    reached = matched.sum(dim=0).double()  # blocks whose first k + 1 drafts were accepted
    before = torch.cat([reached.new_tensor([matched.shape[0]]), reached[:-1]])
    report = dict(
        num_blocks=matched.shape[0],
        mean_accepted_length=round(float(matched.sum(dim=1).double().mean() + 1), 4),  # + the bonus token
        # P(draft k accepted | drafts < k accepted): what the confidence head's c_k estimates
        acceptance_per_position=[round(float(r), 4) for r in reached / before.clamp(min=1)],
        # P(drafts 0..k all accepted)
        prefix_acceptance=[round(float(r), 4) for r in reached / matched.shape[0]],
        held_out_loss={k: round(v, 4) for k, v in held_out_loss.items()},
    )
    if confidence is not None:
        report["mean_confidence_per_position"] = [round(float(c), 4) for c in confidence.mean(dim=0)]
    return report


class ServedAcceptance:
    """Greedy acceptance as serving sees it: on the held-out prompts continued by the target's own greedy tokens,
    blocks are drafted where the previous verify left off (the first at the first generated token; after a
    block with a accepted drafts the next anchor is a + 1 positions later, the target's bonus token), each draft
    counted while it and those before it equal the target's tokens. The target is frozen, so its taps on these
    sequences are computed once; each evaluation runs the draft alone."""

    def __init__(self, target: KimiK3ForCausalLM, data: Continuations, taps: tuple[int, ...]):
        self.embed, self.lm_head = target.model.embed_tokens, target.lm_head
        device = target.lm_head.weight.device
        self.sequences = [s.to(device) for s in data.sequences]
        self.prompt_lens = data.prompt_lens
        with torch.no_grad():
            self.taps = [target(ids, tap_layers=taps).taps for ids in self.sequences]

    @torch.no_grad()
    def evaluate(self, model: K3DSparkModel) -> dict:
        matched, confidence = [], []
        for ids, taps, start in zip(self.sequences, self.taps, self.prompt_lens, strict=True):
            # every anchor's block in one pass (cheap), then the walk serving takes through them
            anchors = torch.arange(start, ids.numel() - BLOCK_SIZE, device=ids.device)
            if anchors.numel() == 0:
                continue
            context_rows = model.context_rows(taps, torch.arange(ids.numel(), device=ids.device))
            block_ids = torch.full((anchors.numel(), BLOCK_SIZE), model.config.mask_token_id, device=ids.device)
            block_ids[:, 0] = ids[anchors]
            hidden = model.block_forward(self.embed(block_ids.reshape(-1)), slot_positions(anchors).reshape(-1),
                                         context_rows, block_visibility(anchors, ids.numel()))
            hidden = hidden.view(anchors.numel(), BLOCK_SIZE, -1)
            drafts = greedy_drafts(model, self.lm_head(hidden), ids[anchors])
            hits = (drafts == ids[slot_positions(anchors) + 1]).long().cumprod(dim=1)
            visited, a = [], 0
            while a < anchors.numel():
                visited.append(a)
                a += int(hits[a].sum()) + 1
            visited = torch.tensor(visited, device=ids.device)
            matched.append(hits[visited])
            conf = model.confidence(hidden[visited], torch.cat([ids[anchors[visited], None],
                                                                drafts[visited, :-1]], dim=1))
            if conf is not None:
                confidence.append(conf)
        return acceptance_report(torch.cat(matched), torch.cat(confidence) if confidence else None, {})


def held_out_prompts(tokenizer: KimiTokenizer) -> list[list[int]]:
    """The prompts the serving benchmark and the CI acceptance test use (heldout_prompts.json)."""
    texts = json.loads((Path(__file__).parent / "heldout_prompts.json").read_text())["prompts"]
    return [tokenizer.encode(t) for t in texts]


def served_continuations(target: KimiK3ForCausalLM, tokenizer: KimiTokenizer, new_tokens: int,
                         cache: Path | None) -> Continuations:
    """The held-out prompts and the target's greedy continuation of each, read from `cache` where it exists
    (written there otherwise: they depend only on the target)."""
    prompts = held_out_prompts(tokenizer)
    if cache is not None and cache.exists():
        data = Continuations.load(cache)
        lens = data.prompt_lens
        longest = max(s.numel() - n for s, n in zip(data.sequences, lens, strict=True))  # a stop id ends some early
        if lens != [len(p) for p in prompts] or longest != new_tokens:
            raise ValueError(f"{cache} does not hold the held-out prompts continued by {new_tokens} tokens: "
                             "delete it (it is regenerated) or pass the --served-tokens it was made with")
        return data
    with torch.no_grad():
        data = generate(target, tokenizer, prompts, [new_tokens] * len(prompts), 0.0, seed=0)
    if cache is not None:
        data.save(cache)
    return data


# --- the command --------------------------------------------------------------------------------------------


def checkpoint_tensors(model: K3DSparkModel, target: KimiK3ForCausalLM) -> dict[str, Tensor]:
    """The draft's weights plus the copy of the frozen target embedding the Inferact layout carries."""
    tensors = {name: t.detach().cpu() for name, t in model.state_dict().items()}
    tensors[EMBED_TOKENS] = target.model.embed_tokens.weight.detach().cpu().to(model.dtype)
    return tensors


def format_acceptance(report: dict) -> str:
    rates = " ".join(f"{r:.2f}" for r in report["acceptance_per_position"])
    return f"mean accepted length {report['mean_accepted_length']:.3f} (per position: {rates})"


def init_report(init: Path | None) -> dict | None:
    """The training.json of the draft a run starts from (None: random weights, or a draft without one)."""
    path = None if init is None else init / "training.json"
    return json.loads(path.read_text()) if path is not None and path.exists() else None


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m mstar.training.draft", description=__doc__.split("\n\n")[0])
    p.add_argument("target_dir", type=Path, help="the frozen target: HF checkpoint directory with its tokenizer")
    p.add_argument("out_dir", type=Path)
    p.add_argument("--steps", type=int, default=DraftTrainConfig.steps)
    p.add_argument("--batch", type=int, default=DraftTrainConfig.batch, help="windows per step")
    p.add_argument("--seq-len", type=int, default=DraftTrainConfig.seq_len)
    p.add_argument("--anchors", type=int, default=DraftTrainConfig.anchors, help="blocks per window")
    p.add_argument("--lr", type=float, default=DraftTrainConfig.lr)
    p.add_argument("--warmup", type=int, default=DraftTrainConfig.warmup, help="steps of linear warmup")
    p.add_argument("--eval-windows", type=int, default=DraftTrainConfig.eval_windows)
    p.add_argument("--served-tokens", type=int, default=96,
                   help="greedy target tokens after each held-out prompt, for the served acceptance")
    p.add_argument("--engine-tokens", type=int, default=NEW_TOKENS,
                   help="greedy tokens per held-out prompt for the acceptance through the engine, before and after")
    p.add_argument("--served-data", type=Path, help="cache file of the held-out prompts' greedy continuations "
                   "(read if it exists, else written)")
    p.add_argument("--served-eval-every", type=int, default=DraftTrainConfig.served_eval_every,
                   help="steps between points of the served acceptance's learning curve")
    p.add_argument("--train-data", type=Path, nargs="+", help="files of the target's continuations (python -m "
                   "mstar.training.continuations) to train on instead of corpus windows")
    p.add_argument("--init", type=Path, help="a draft checkpoint to start from (its config and weights) instead "
                   "of random weights")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    cfg = DraftTrainConfig(
        steps=args.steps,
        batch=args.batch,
        seq_len=args.seq_len,
        anchors=args.anchors,
        lr=args.lr,
        warmup=args.warmup,
        eval_windows=args.eval_windows,
        served_eval_every=args.served_eval_every,
    )
    device = torch.device(args.device)
    t0 = time.monotonic()

    target = frozen_target(args.target_dir, device)
    tokenizer = KimiTokenizer.from_dir(args.target_dir)
    corpus = build_corpus(tokenizer)
    print(
        f"target: {args.target_dir} ({target.config.num_hidden_layers} layers); corpus: "
        f"{corpus.train.numel():,} train tokens, {corpus.held_out.numel():,} held out"
    )
    train_data = corpus.train if args.train_data is None else Continuations.load_all(args.train_data)
    if args.init is None:
        raw = mini_dspark_raw_config(target.config)
        model = new_draft(raw, cfg.seed, device)
    else:
        raw = json.loads((args.init / "config.json").read_text())
        model = K3DSparkModel.from_checkpoint(args.init, dtype=torch.float32).to(device)
    model.requires_grad_(True)
    parameters = sum(p.numel() for p in model.parameters())
    print(f"draft: {parameters:,} parameters, taps on target layers {raw['target_layer_ids']}, block size {BLOCK_SIZE}")

    eval_windows = fixed_windows(corpus.held_out, cfg.seq_len, cfg.eval_windows).to(device)
    held_out = served_continuations(target, tokenizer, args.served_tokens, args.served_data)
    served = ServedAcceptance(target, held_out, model.config.target_layer_ids)
    before = evaluate(model.eval(), target, eval_windows, cfg.eval_anchor_stride)
    served_before = served.evaluate(model)
    prompts = held_out_prompts(tokenizer)
    engine_before = engine_acceptance(target, tokenizer, prompts, model.eval(), BLOCK_SIZE, args.engine_tokens)
    print(f"held out, before: {format_acceptance(before)}; served: {format_acceptance(served_before)}; engine: "
          f"{engine_before['mean_accepted_length']:.3f}")
    train_start = time.monotonic()
    history, curve = train(model, target, train_data, cfg, device, served)
    train_seconds = time.monotonic() - train_start
    after = evaluate(model, target, eval_windows, cfg.eval_anchor_stride)
    served_after = served.evaluate(model)
    engine_after = engine_acceptance(target, tokenizer, prompts, model.eval(), BLOCK_SIZE, args.engine_tokens)
    print(f"held out, after:  {format_acceptance(after)}; served: {format_acceptance(served_after)}; engine: "
          f"{engine_after['mean_accepted_length']:.3f}")

    save_dspark_checkpoint(args.out_dir, raw, checkpoint_tensors(model, target))
    tokens = history[-1]["tokens"]
    report = dict(
        train=asdict(cfg),
        block_size=BLOCK_SIZE,
        target=str(args.target_dir),
        device=str(device),
        torch=torch.__version__,
        draft_config=raw,
        parameters=parameters,
        loss_weights=dict(ce=CE_WEIGHT, l1=L1_WEIGHT, confidence=CONFIDENCE_WEIGHT, l1_decay=L1_DECAY),
        train_tokens=corpus.train.numel(),
        held_out_tokens=corpus.held_out.numel(),
        tokens_seen=tokens,
        history=history,
        train_seconds=round(train_seconds, 1),
        tokens_per_s=round(tokens / train_seconds, 1),
        train_data=dict(source="corpus windows") if args.train_data is None else dict(
            source="the target's continuations of training-stream prompts", files=[str(f) for f in args.train_data],
            sequences=len(train_data.sequences), continuation_tokens=train_data.num_continuation_tokens(),
            temperature=train_data.temperature),
        init=None if args.init is None else str(args.init),
        # the starting draft's own record, so that a card can tell every stage of the weights it describes
        init_report=init_report(args.init),
        acceptance=dict(
            method="greedy draft blocks vs the target's greedy tokens given the true prefix (held-out windows)",
            before=before,
            after=after,
        ),
        served_acceptance=dict(
            method=f"the {len(held_out.sequences)} held-out prompts continued by {args.served_tokens} greedy target "
            "tokens; blocks drafted where the previous verify left off, greedy verification",
            before=served_before,
            after=served_after,
            curve=curve,
        ),
        engine_acceptance=dict(before=engine_before, after=engine_after),
        minutes=round((time.monotonic() - t0) / 60, 1),
    )
    (args.out_dir / "training.json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out_dir}")


if __name__ == "__main__":
    main()
