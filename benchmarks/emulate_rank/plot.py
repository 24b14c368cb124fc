"""Decode step time / byte floor of the emulated pruned75 TP8 rank, per commit and batch size, from the
mstar-emulate-rank JSON files beside this script:  python benchmarks/emulate_rank/plot.py"""

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).parent
RUNS = [("1a7aa0b", "h200_1a7aa0b_decode_verify.json", "graphs"),
        ("d7044cf", "h200_d7044cf_decode_profile.json", "+ fused norms, AttnRes, router, KDA conv"),
        ("5c694d9", "h200_5c694d9_decode.json", "+ retiled AttnRes, stacked projections, MoE decode path"),
        ("7c11d4a", "h200_7c11d4a_all.json", "+ AttnRes split over column chunks")]

fig, ax = plt.subplots(figsize=(7, 4))
for commit, name, label in RUNS:
    rows = [r for r in json.loads((HERE / name).read_text())["rows"] if r["step"] == "decode"]
    ax.plot([r["batch"] for r in rows], [r["ratio"] for r in rows], marker="o", label=f"{commit}: {label}")
ax.axhline(1.33, color="green", linestyle="--", label="target at C=1 (1.33x)")
ax.axhline(1.5, color="olive", linestyle=":", label="target at C=64 (1.5x)")
ax.set(xscale="log", xlabel="decode batch", ylabel="measured / byte floor", ylim=(0, 7),
       title="pruned75, one TP8 rank on an H200: decode step vs its byte floor")
ax.set_xticks([1, 8, 16, 32, 64], labels=["1", "8", "16", "32", "64"])
ax.legend(fontsize=7)
fig.tight_layout()
fig.savefig(HERE / "decode_vs_floor.png", dpi=120)
