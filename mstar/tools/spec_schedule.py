"""`mstar-spec-schedule DIR`: pick `speculative_schedule` from serving sweeps at several draft counts.

(`mstar-spec-schedule --emulation FILE` picks it from an `mstar-emulate-rank` report instead: the step
times of decode, verify and draft steps at one rank's real dimensions and the report's acceptance
profile give each (batch, k) an implied rate, batch x tokens per step / step time; see below.)

DIR holds `k<K>.json` files written by `mstar-bench-serve --name k<K>` against the same server config
with `model_kwargs.speculative_tokens=K` (k0 = no speculation). For every concurrency the draft count
with the highest output tok/s wins; runs of concurrencies with the same winner become one bucket
(`{largest C of the run: K}`), the form `model_kwargs.speculative_schedule` takes. Writes
DIR/schedule.md (tok/s per K and C, speedup over K=0, acceptance, the schedule) and DIR/schedule.png.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path


def load_sweeps(directory: Path) -> dict[int, dict[int, dict]]:
    """{K: {C: level record}} from DIR/k<K>.json."""
    sweeps = {}
    for path in sorted(directory.glob("k*.json")):
        match = re.fullmatch(r"k(\d+)\.json", path.name)
        if match:
            levels = json.loads(path.read_text())["levels"]
            sweeps[int(match.group(1))] = {lv["concurrency"]: lv for lv in levels}
    if 0 not in sweeps or len(sweeps) < 2:
        raise SystemExit(f"{directory}: need k0.json (no speculation) and at least one k<K>.json; "
                         f"found {sorted(sweeps)}")
    return sweeps


def sweeps_from_emulation(path: Path) -> dict[int, dict[int, dict]]:
    """{K: {batch: level record}} of implied rates from an mstar-emulate-rank JSON report's speculative rows:
    batch / t_decode for K = 0, batch x tokens per step / (t_draft + t_verify) for each measured K."""
    rows = json.loads(path.read_text()).get("speculative") or []
    if not rows:
        raise SystemExit(f"{path}: no speculative rows; run mstar-emulate-rank with decode, verify and draft steps "
                         "at the same batch sizes (--steps decode,verify,draft)")
    sweeps: dict[int, dict[int, dict]] = {0: {}}
    for r in rows:
        b = r["batch"]
        sweeps[0][b] = {"concurrency": b, "output_tok_s": b / r["t_decode_s"]}
        sweeps.setdefault(r["drafts"], {})[b] = {
            "concurrency": b, "output_tok_s": b * r["tokens_per_step"] / (r["t_draft_s"] + r["t_verify_s"]),
            "mean_accepted_length": r["tokens_per_step"]}
    return sweeps


def best_drafts(sweeps: dict[int, dict[int, dict]]) -> dict[int, int]:
    """{C: K with the highest output tok/s}, over the concurrencies every sweep measured."""
    levels = sorted(set.intersection(*(set(s) for s in sweeps.values())))
    return {c: max(sweeps, key=lambda k: sweeps[k][c]["output_tok_s"]) for c in levels}


def schedule_buckets(best: dict[int, int]) -> dict[int, int]:
    """Merge consecutive concurrencies with the same winner; a bucket is keyed by its largest C."""
    buckets: dict[int, int] = {}
    levels = sorted(best)
    for i, c in enumerate(levels):
        if i + 1 == len(levels) or best[levels[i + 1]] != best[c]:
            buckets[c] = best[c]
    return buckets


def report(sweeps: dict[int, dict[int, dict]], best: dict[int, int], buckets: dict[int, int]) -> str:
    ks = sorted(sweeps)
    header = "| C | " + " | ".join(f"k={k} tok/s" for k in ks) + " | best k | speedup vs k=0 | accepted length |"
    lines = [header, "|---" * (len(ks) + 4) + "|"]
    for c, k in best.items():
        rates = " | ".join(f"{sweeps[kk][c]['output_tok_s']:.1f}" for kk in ks)
        speedup = sweeps[k][c]["output_tok_s"] / sweeps[0][c]["output_tok_s"]
        accepted = sweeps[k][c].get("mean_accepted_length")
        lines.append(f"| {c} | {rates} | {k} | {speedup:.2f}x | {f'{accepted:.2f}' if accepted else '—'} |")
    schedule = "{" + ", ".join(f"{c}: {k}" for c, k in buckets.items()) + "}"
    return "\n".join(lines) + f"\n\nBest `model_kwargs.speculative_schedule`: `{schedule}`\n"


def plot(sweeps: dict[int, dict[int, dict]], path: Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (ax_rate, ax_gain) = plt.subplots(1, 2, figsize=(11, 3.8))
    for k, levels in sorted(sweeps.items()):
        cs = sorted(levels)
        ax_rate.plot(cs, [levels[c]["output_tok_s"] for c in cs], "o-", label="no DSpark" if k == 0 else f"k={k}")
        if k:
            ax_gain.plot(cs, [levels[c]["output_tok_s"] / sweeps[0][c]["output_tok_s"] for c in cs if c in sweeps[0]],
                         "o-", label=f"k={k}")
    ax_rate.set_ylabel("output tok/s")
    ax_gain.set_ylabel("speedup over no DSpark")
    ax_gain.axhline(1.0, color="gray", lw=0.8)
    for ax in (ax_rate, ax_gain):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="mstar-spec-schedule", description=__doc__.split("\n\n")[0])
    p.add_argument("directory", type=Path, nargs="?", help="the sweeps' folder (k0.json, k<K>.json)")
    p.add_argument("--emulation", type=Path, default=None,
                   help="an mstar-emulate-rank JSON report: implied rates per batch (C) instead of served sweeps")
    p.add_argument("--title", default="", help="plot and table title (model, machine)")
    args = p.parse_args(argv)
    if (args.directory is None) == (args.emulation is None):
        p.error("give either the sweeps' DIR or --emulation FILE")
    sweeps = sweeps_from_emulation(args.emulation) if args.emulation else load_sweeps(args.directory)
    out = args.emulation.parent if args.emulation else args.directory
    name = args.title or out.name
    best = best_drafts(sweeps)
    buckets = schedule_buckets(best)
    what = "implied output tok/s (emulated steps)" if args.emulation else "output tok/s"
    text = f"## {name}: {what} by draft count\n\n" + report(sweeps, best, buckets)
    (out / "schedule.md").write_text(text)
    if plot(sweeps, out / "schedule.png", name):
        print(f"wrote {out / 'schedule.png'}", file=sys.stderr)
    print(text)


if __name__ == "__main__":
    main()
