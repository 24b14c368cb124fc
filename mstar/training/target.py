"""Train a small Kimi K3 (every component: KDA and MLA layers, AttnRes blocks, latent MoE with SiTU and
MXFP4 routed experts) on the Python standard library, with the reference model's differentiable path.

    python -m mstar.training.target OUT_DIR [--steps N] [--device cpu|cuda]

writes OUT_DIR/ as an HF checkpoint (config.json, safetensors with compressed-tensors MXFP4 experts,
K3-layout tokenizer) and OUT_DIR/training.json (losses, perplexities, timing) for the model card.

Routing is balanced without an auxiliary loss (DeepSeek-V3's bias update): after each step every
layer's `e_score_correction_bias` moves by `BIAS_RATE` towards experts that got fewer tokens than the
mean. The bias only selects experts, so it carries no gradient.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from mstar.models.kimi_k3.config import parse_config
from mstar.models.kimi_k3.kda import KimiDeltaAttention
from mstar.models.kimi_k3.model import KimiK3ForCausalLM, dense_mixer
from mstar.models.kimi_k3.moe import Router
from mstar.models.kimi_k3.tokenizer import KimiTokenizer
from mstar.models.kimi_k3.weights import checkpoint_tensors, load_model, save_checkpoint
from mstar.tools.make_tiny import TINY_MLA, tiny_k3_raw_config
from mstar.tools.train_bpe import stdlib_corpus, train_bpe_ranks, write_tokenizer_dir
from mstar.training.corpus import Corpus, build_corpus, fixed_windows, random_windows

NUM_RANKS = 2048  # BPE ranks; K3's 256 special tokens follow
TOKENIZER_CORPUS_BYTES = 1_500_000
BIAS_RATE = 1e-3
KDA_TRAINING_CHUNK = 16  # ~2x faster than the default 64 on CPU for the same math


def mini_k3_raw_config(num_ranks: int = NUM_RANKS) -> dict:
    """K3's config with small dims: 6 layers (KDA, KDA, MLA) x 2, 8 routed experts (top 2) + 1 shared."""
    raw = tiny_k3_raw_config(num_ranks)
    raw["text_config"].update(
        hidden_size=256,
        num_hidden_layers=6,
        **TINY_MLA,
        intermediate_size=768,
        moe_intermediate_size=256,
        num_experts=8,
        num_experts_per_token=2,
        num_shared_experts=1,
        routed_expert_hidden_size=128,
        attn_res_block_size=2,
        max_position_embeddings=4096,
    )
    raw["text_config"]["linear_attn_config"].update(head_dim=32, num_heads=8, full_attn_layers=[3, 6],
                                                    kda_layers=[1, 2, 4, 5])
    return raw


@dataclass
class TrainConfig:
    steps: int = 1500
    seq_len: int = 256
    batch: int = 8  # sequences per step
    lr: float = 3e-3
    warmup: int = 100
    weight_decay: float = 0.05
    seed: int = 0
    eval_windows: int = 48


def use_training_chunks(model: KimiK3ForCausalLM) -> None:
    """Shorter KDA chunks for training passes: the same math, ~2x faster on CPU (KDA_TRAINING_CHUNK)."""
    for m in model.modules():
        if isinstance(m, KimiDeltaAttention):
            m.chunk_size = KDA_TRAINING_CHUNK


def sequence_logits(model: KimiK3ForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    """Differentiable logits [T, V] of one sequence from a fresh state (the reference forward is no-grad)."""
    hidden, _ = model.model(ids, dense_mixer(model.model, model.new_state(), absorbed=False))
    return model.lm_head(hidden)


def batch_loss(model: KimiK3ForCausalLM, windows: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over a [B, T+1] batch (sequences run one by one)."""
    losses = [F.cross_entropy(sequence_logits(model, w[:-1]), w[1:]) for w in windows]
    return torch.stack(losses).mean()


@torch.no_grad()
def perplexity(model: KimiK3ForCausalLM, windows: torch.Tensor) -> float:
    return math.exp(float(batch_loss(model, windows)))


class RouterBalance:
    """Counts expert selections per router during a step, then nudges each bias towards balance."""

    def __init__(self, model: KimiK3ForCausalLM, rate: float = BIAS_RATE):
        self.rate = rate
        self.routers = [m for m in model.modules() if isinstance(m, Router)]
        self.counts = {id(r): torch.zeros(r.config.num_experts) for r in self.routers}
        for r in self.routers:
            r.e_score_correction_bias.requires_grad_(False)
            r.register_forward_hook(self._count)

    def _count(self, router: Router, _args, routing) -> None:
        ids = routing.experts.detach().reshape(-1).cpu()
        self.counts[id(router)] += torch.bincount(ids, minlength=router.config.num_experts).float()

    @torch.no_grad()
    def update(self) -> float:
        """Apply the bias step; returns the worst max/mean load ratio seen this step."""
        worst = 1.0
        for r in self.routers:
            load = self.counts[id(r)]
            if load.sum() > 0:
                worst = max(worst, float(load.max() / load.mean()))
                r.e_score_correction_bias += self.rate * torch.sign(load.mean() - load).to(r.e_score_correction_bias)
            load.zero_()
        return worst


def make_optimizer(model: KimiK3ForCausalLM, cfg: TrainConfig) -> torch.optim.Optimizer:
    decay, plain = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 and "embed" not in name else plain).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": plain, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95))


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def train_tokenizer(out_dir: Path) -> KimiTokenizer:
    ranks = train_bpe_ranks(stdlib_corpus(TOKENIZER_CORPUS_BYTES), NUM_RANKS)
    write_tokenizer_dir(out_dir, ranks)
    return KimiTokenizer.from_dir(out_dir)


def train(model: KimiK3ForCausalLM, corpus: Corpus, cfg: TrainConfig, device: torch.device, log=print) -> list[dict]:
    gen = torch.Generator().manual_seed(cfg.seed)
    opt = make_optimizer(model, cfg)
    balance = RouterBalance(model)
    use_training_chunks(model)
    history = []
    start = time.monotonic()
    for step in range(cfg.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        windows = random_windows(corpus.train, cfg.seq_len + 1, cfg.batch, gen).to(device)
        loss = batch_loss(model, windows)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        imbalance = balance.update()
        if step % 25 == 0 or step == cfg.steps - 1:
            elapsed = time.monotonic() - start
            tok_s = (step + 1) * cfg.batch * cfg.seq_len / elapsed
            history.append(dict(step=step, loss=round(loss.item(), 4), seconds=round(elapsed, 1)))
            log(f"step {step:5d}/{cfg.steps}  loss {loss.item():.3f}  lr {lr_at(step, cfg):.2e}  "
                f"expert load max/mean {imbalance:.2f}  {tok_s:,.0f} tok/s  {elapsed / 60:.1f} min")
    return history


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m mstar.training.target", description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir", type=Path)
    p.add_argument("--steps", type=int, default=TrainConfig.steps)
    p.add_argument("--batch", type=int, default=TrainConfig.batch)
    p.add_argument("--seq-len", type=int, default=TrainConfig.seq_len)
    p.add_argument("--lr", type=float, default=TrainConfig.lr)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    cfg = TrainConfig(steps=args.steps, batch=args.batch, seq_len=args.seq_len, lr=args.lr)
    device = torch.device(args.device)
    out = args.out_dir
    out.mkdir(parents=True, exist_ok=True)

    t0 = time.monotonic()
    tokenizer = train_tokenizer(out)
    corpus = build_corpus(tokenizer)
    print(f"tokenizer: {tokenizer.vocab_size} ids; corpus: {corpus.train.numel():,} train tokens "
          f"({corpus.num_files[0]} files), {corpus.held_out.numel():,} held out ({corpus.num_files[1]} files)")

    raw = mini_k3_raw_config()
    torch.manual_seed(cfg.seed)
    model = KimiK3ForCausalLM(parse_config(raw)).to(device).train()
    num_parameters = sum(p.numel() for p in model.parameters())
    print(f"model: {num_parameters:,} parameters")
    history = train(model, corpus, cfg, device)
    model.eval()

    eval_windows = fixed_windows(corpus.held_out, cfg.seq_len + 1, cfg.eval_windows).to(device)
    ppl = {"fp32 (as trained)": perplexity(model, eval_windows)}
    with tempfile.TemporaryDirectory() as tmp:  # bf16 weights, experts unquantized: isolates MXFP4's loss
        save_checkpoint(tmp, raw, checkpoint_tensors(model, quantize_experts=False))
        ppl["bf16 checkpoint"] = perplexity(load_model(tmp, dtype=torch.float32, device=device), eval_windows)
    save_checkpoint(out, raw, checkpoint_tensors(model, quantize_experts=True))
    ppl["bf16 + MXFP4 experts (shipped)"] = perplexity(load_model(out, dtype=torch.float32, device=device),
                                                        eval_windows)
    report = dict(
        train=asdict(cfg), device=str(device), torch=torch.__version__,
        parameters=num_parameters,
        train_tokens=corpus.train.numel(), held_out_tokens=corpus.held_out.numel(), files=corpus.num_files,
        tokens_seen=cfg.steps * cfg.batch * cfg.seq_len, history=history,
        held_out_perplexity={k: round(v, 3) for k, v in ppl.items()},
        minutes=round((time.monotonic() - t0) / 60, 1),
    )
    (out / "training.json").write_text(json.dumps(report, indent=1) + "\n")
    print("held-out perplexity: " + ", ".join(f"{k} {v:.3f}" for k, v in ppl.items()) + f"; wrote {out}")


if __name__ == "__main__":
    main()
