"""Model cards for the trained pair, written from the trainers' training.json files:

    python -m mstar.training.card TARGET_DIR DRAFT_DIR

writes TARGET_DIR/README.md (with sample completions), DRAFT_DIR/README.md, TARGET_DIR/loss.png (both loss
curves) and DRAFT_DIR/acceptance.png (the draft's served acceptance as it trained), so the cards always carry
the numbers of the weights next to them.
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch

from mstar.models.kimi_k3.config import parse_config
from mstar.models.kimi_k3.generate import greedy_generate
from mstar.models.kimi_k3.tokenizer import KimiTokenizer
from mstar.models.kimi_k3.weights import load_model

SAMPLE_PROMPTS = ("def is_prime(n):\n", "class Stack:\n    def __init__(self):\n", "import os\n\n\ndef main():\n")
SAMPLE_TOKENS = 48


def dir_megabytes(path: Path) -> float:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file()) / 1e6


def samples(target_dir: Path) -> list[tuple[str, str]]:
    model = load_model(target_dir, dtype=torch.float32)
    tokenizer = KimiTokenizer.from_dir(target_dir)
    out = []
    for prompt in SAMPLE_PROMPTS:
        ids = greedy_generate(model, tokenizer.encode(prompt), SAMPLE_TOKENS, stop_ids=tokenizer.stop_ids)
        out.append((prompt, tokenizer.decode([t for t in ids if not tokenizer.is_special(t)])))
    return out


def plot_losses(target: dict, draft: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    runs = len(stages(draft))
    draft_title = "draft: DSpark loss" + (f" (stage {runs} of {runs})" if runs > 1 else "")
    for ax, report, title in ((axes[0], target, "target: next-token CE"), (axes[1], draft, draft_title)):
        ax.plot([h["step"] for h in report["history"]], [h["loss"] for h in report["history"]])
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def stage_starts(draft: dict) -> list[int]:
    """Tokens trained on before each stage began."""
    starts, offset = [], 0
    for run in stages(draft):
        starts.append(offset)
        offset += run["tokens_seen"]
    return starts


def served_curve(draft: dict) -> list[dict]:
    """The served acceptance as the weights trained, over every stage that measured it: (stage, step, tokens
    trained on since the first stage began, mean accepted length), from the first measured stage's start."""
    points = []
    for number, (run, offset) in enumerate(zip(stages(draft), stage_starts(draft), strict=True), 1):
        served = run.get("served_acceptance")  # absent for a run made before the trainer measured it
        if served is None:
            continue
        if not points:
            points.append(dict(stage=number, step=0, tokens=offset,
                               mean_accepted_length=served["before"]["mean_accepted_length"]))
        points += [dict(stage=number, step=c["step"], tokens=offset + c["tokens"],
                        mean_accepted_length=c["mean_accepted_length"]) for c in served["curve"]]
    return points


def plot_served_curve(draft: dict, path: Path) -> bool:
    """The learning curve: mean accepted length per verify as serving sees it, against the tokens trained on
    (all stages), a dotted line where each measured stage begins."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    curve = served_curve(draft)
    if not curve:
        return False
    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    ax.plot([c["tokens"] / 1e3 for c in curve], [c["mean_accepted_length"] for c in curve], marker="o")
    for number, start in enumerate(stage_starts(draft), 1):
        if number >= curve[0]["stage"]:
            ax.axvline(start / 1e3, color="grey", lw=0.8, ls=":")
            ax.annotate(f" stage {number}", (start / 1e3, 0.02), xycoords=("data", "axes fraction"), fontsize=8)
    ax.set_title(f"draft: served acceptance at k={draft['block_size']}")
    ax.set_xlabel("thousand tokens trained on (all stages)")
    ax.set_ylabel("mean accepted length")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def target_card(target_dir: Path, draft_dir: Path, report: dict, draft_report: dict) -> str:
    cfg = parse_config(json.loads((target_dir / "config.json").read_text()))
    la = cfg.linear_attn
    kda = [i for i in range(cfg.num_hidden_layers) if cfg.is_kda_layer(i)]
    mla = [i for i in range(cfg.num_hidden_layers) if i not in kda]
    ppl = "\n".join(f"| {name} | {value:.3f} |" for name, value in report["held_out_perplexity"].items())
    # the acceptance as served where the draft's trainer measured it, else the corpus-window one
    served, engine = draft_report.get("served_acceptance"), draft_report.get("engine_acceptance")
    acc = engine["after"] if engine else served["after"] if served else draft_report["acceptance"]["after"]
    how = ("greedy, held-out prompts through the engine" if engine else
           "greedy, held-out prompts, drafted as served" if served else "greedy, held-out corpus windows")
    lines = [
        "# kimi_k3_mini",
        "",
        "A small model with Kimi K3's architecture, trained by mstar on the Python standard library so that",
        "the engine has something real to serve and DSpark something real to accelerate. It completes",
        "Python code; it knows nothing else. Served by `mstar-serve --config configs/kimi_k3_mini.yaml`.",
        "",
        "## Architecture (config.json)",
        "",
        f"- {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}: KDA layers {kda} ({la.num_heads} heads x "
        f"{la.head_dim}), MLA layers {mla} (0-based)",
        f"- latent MoE: {cfg.num_experts} routed experts (top {cfg.num_experts_per_token}, SiTU, MXFP4 in the "
        f"checkpoint) in a {cfg.routed_expert_hidden_size}-wide latent space + {cfg.num_shared_experts} shared expert",
        f"- block attention residuals (blocks of {cfg.attn_res_block_size} layers)",
        f"- {report['parameters']:,} parameters; vocabulary {cfg.vocab_size} (BPE ranks trained on the same text, "
        "K3's tokenizer layout and special tokens)",
        f"- files: {dir_megabytes(target_dir):.1f} MB (bf16 weights, MXFP4 routed experts, fp32 where K3 keeps fp32)",
        "",
        "## Training (`python -m mstar.training.target`)",
        "",
        f"- data: the standard library of Python {report.get('python', platform.python_version())} "
        f"({report['files'][0]} files, {report['train_tokens']:,} tokens; {report['files'][1]} files, "
        f"{report['held_out_tokens']:,} tokens held out by path hash)",
        f"- {report['train']['steps']} steps of {report['train']['batch']} x {report['train']['seq_len']} tokens "
        f"({report['tokens_seen']:,} tokens), AdamW lr {report['train']['lr']}, warmup + cosine; routing balanced by "
        "the bias update (no auxiliary loss)",
        f"- final training loss {report['history'][-1]['loss']:.3f}; {report['minutes']} min on {report['device']} "
        f"(torch {report['torch']})",
        "",
        "Held-out perplexity (256-token windows):",
        "",
        "| weights | perplexity |",
        "|---|---|",
        ppl,
        "",
        "![loss curves](loss.png)",
        "",
        f"## Its DSpark draft: `{draft_dir.name}`",
        "",
        f"Mean accepted length {acc['mean_accepted_length']:.2f} tokens per verify at k = "
        f"{draft_report['block_size']} ({how}); "
        f"see {draft_dir.name}/README.md, and benchmarks/mini_pair/ for the engine's figures.",
        "",
        "## Samples (greedy, 48 tokens)",
        "",
    ]
    for prompt, completion in samples(target_dir):
        lines += ["```python", prompt + completion, "```", ""]
    lines += ["Trained on CPython's standard library source (PSF license)."]
    return "\n".join(lines) + "\n"


def rates_table(report: dict) -> list[str]:
    rates = " | ".join(f"{r:.2f}" for r in report["acceptance_per_position"])
    positions = " | ".join(str(i + 1) for i in range(len(report["acceptance_per_position"])))
    return [
        f"| draft position | {positions} |",
        "|---" * (len(report["acceptance_per_position"]) + 1) + "|",
        f"| P(accepted given the earlier ones were) | {rates} |",
    ]


def data_line(report: dict) -> str:
    data = report["train_data"]
    if data["source"] == "corpus windows":
        return "- data: windows of the training corpus (teacher-forced corpus text)"
    how = "greedy" if data["temperature"] == 0 else f"sampled at temperature {data['temperature']}"
    return (f"- data: {data['source']}: {data['sequences']} sequences, {data['continuation_tokens']:,} continuation "
            f"tokens ({how}, through the engine: `python -m mstar.training.continuations`); anchors in the "
            "continuations only")


def served_section(report: dict, curve_plotted: bool) -> list[str]:
    """The card's lines on the acceptance as served and its learning curve over the stages that measured it
    (none for a draft trained before the trainer measured it)."""
    served, curve = report.get("served_acceptance"), served_curve(report)
    if served is None:
        return []
    first = curve[0]
    return [
        "## Acceptance as served (greedy, held-out prompts, k = 7)",
        "",
        f"{served['method']}. Mean accepted length per verify (accepted drafts + 1): "
        f"{first['mean_accepted_length']:.2f} before stage {first['stage']}, "
        f"**{served['after']['mean_accepted_length']:.2f}** after the last ({served['after']['num_blocks']} blocks).",
        "",
        *rates_table(served["after"]),
        "",
        *engine_lines(report.get("engine_acceptance")),
        "Learning curve (tokens: trained on since stage 1 began):",
        "",
        "| stage | step | tokens | mean accepted length |",
        "|---|---|---|---|",
        *[f"| {c['stage']} | {c['step']} | {c['tokens']:,} | {c['mean_accepted_length']:.2f} |" for c in curve],
        "",
        *(["![served acceptance](acceptance.png)", ""] if curve_plotted else []),
    ]


def stage_lines(report: dict, after_a_stage: bool) -> list[str]:
    """One training run's bullets: its data, where it started, its steps and tokens."""
    if report["init"] is None:
        start = "random weights"
    else:
        start = "the draft of the stage before" if after_a_stage else f"the draft at `{report['init']}`"
    return [
        data_line(report),
        f"- from {start}, frozen target, {report['train']['steps']} steps of {report['train']['batch']} "
        f"sequences of up to {report['train']['seq_len']} tokens, {report['train']['anchors']} random anchors per "
        f"sequence ({report['tokens_seen']:,} tokens), lr {report['train']['lr']}; {report['minutes']} min on "
        f"{report['device']}",
    ]


def stages(report: dict) -> list[dict]:
    """The runs that made the weights, first to last (a run's init_report is the run before it)."""
    earlier = report.get("init_report")
    return (stages(earlier) if earlier else []) + [report]


def engine_lines(engine: dict | None) -> list[str]:
    """The acceptance through the engine (training/served_engine.py), where the trainer measured it."""
    if engine is None:
        return []
    rates = " ".join(f"{r:.2f}" for r in engine["after"]["accepted_by_position"])
    return [f"Through the engine ({engine['after']['method']}; what benchmarks/mini_pair/ and CI measure): "
            f"{engine['before']['mean_accepted_length']:.2f} before this stage, "
            f"**{engine['after']['mean_accepted_length']:.2f}** after; verify rows whose draft 1..7 was accepted: "
            f"{rates}.", ""]


def draft_card(draft_dir: Path, target_dir: Path, report: dict, curve_plotted: bool) -> str:
    before, after = report["acceptance"]["before"], report["acceptance"]["after"]
    w = report["loss_weights"]
    runs = stages(report)
    training = stage_lines(report, False) if len(runs) == 1 else [
        line for i, run in enumerate(runs) for line in [f"Stage {i + 1}:", "", *stage_lines(run, i > 0), ""]][:-1]
    return "\n".join([
        f"# {draft_dir.name}",
        "",
        f"A DSpark draft (K3DSparkModel layout) for `{target_dir.name}`: "
        f"{report['draft_config']['num_hidden_layers']} MLA layers fed by the target's raw residual stream after "
        f"layers {report['draft_config']['target_layer_ids']}, a block of {report['block_size']} "
        f"(the anchor predicts the first draft), a rank-{report['draft_config']['markov_rank']} Markov head and a "
        "confidence head. It borrows the target's embeddings and lm_head.",
        "",
        "## Training (`python -m mstar.training.draft`)",
        "",
        *training,
        "",
        f"Loss {w['ce']} CE + {w['l1']} L1 to the target's distribution (decay {w['l1_decay']}) + "
        f"{w['confidence']} confidence BCE; final {report['history'][-1]['loss']:.3f}. "
        f"{report['parameters']:,} parameters.",
        "",
        *served_section(report, curve_plotted),
        "## Acceptance on corpus text (greedy drafts vs the target's greedy tokens, held-out corpus windows)",
        "",
        f"Mean accepted length per verify: {before['mean_accepted_length']:.2f} before, "
        f"**{after['mean_accepted_length']:.2f}** after ({after['num_blocks']} blocks).",
        "",
        *rates_table(after),
        "",
        "Served speed per concurrency: benchmarks/mini_pair/.",
    ]) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m mstar.training.card", description=__doc__.split("\n\n")[0])
    p.add_argument("target_dir", type=Path)
    p.add_argument("draft_dir", type=Path)
    args = p.parse_args(argv)
    report = json.loads((args.target_dir / "training.json").read_text())
    draft_report = json.loads((args.draft_dir / "training.json").read_text())
    (args.target_dir / "README.md").write_text(target_card(args.target_dir, args.draft_dir, report, draft_report))
    plotted = plot_served_curve(draft_report, args.draft_dir / "acceptance.png")
    (args.draft_dir / "README.md").write_text(draft_card(args.draft_dir, args.target_dir, draft_report, plotted))
    plot_losses(report, draft_report, args.target_dir / "loss.png")
    print(f"wrote {args.target_dir / 'README.md'} and {args.draft_dir / 'README.md'}")


if __name__ == "__main__":
    main()
