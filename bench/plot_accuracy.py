"""Held-out accuracy against wall-clock minutes of training, for any runs' `metrics.jsonl`, on one plot.

    .venv/bin/python bench/plot_accuracy.py --out docs/ppo_vs_grpo.png \
        PPO=runs/rlhf_arithmetic/ppo/metrics.jsonl GRPO=runs/grpo/metrics.jsonl

The x axis is `train_time` (wall seconds of the run minus its evaluations), so runs that evaluate
more often are not penalised for it; each run's curve starts at its step-0 evaluation.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from pagedrl.train.logging import read_metrics  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--title", default="held-out accuracy, arithmetic task")
    parser.add_argument("runs", nargs="+", help="LABEL=path/to/metrics.jsonl")
    args = parser.parse_args()
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for item in args.runs:
        label, _, path = item.partition("=")
        rows = [r for r in read_metrics(path) if "eval/accuracy" in r]
        minutes = [r["train_time"] / 60 for r in rows]
        accuracy = [100 * r["eval/accuracy"] for r in rows]
        ax.plot(minutes, accuracy, marker="o", label=label)
        for m, a, r in zip(minutes, accuracy, rows, strict=True):
            ax.annotate(f"step {r['step']}", (m, a), textcoords="offset points", xytext=(4, -10), fontsize=7)
        print(f"{label}: " + ", ".join(f"step {r['step']} {a:.1f}% at {m:.1f} min"
                                       for r, a, m in zip(rows, accuracy, minutes, strict=True)))
    ax.set_xlabel("training minutes (wall clock, evaluations excluded)")
    ax.set_ylabel("held-out accuracy (%)")
    ax.set_title(args.title)
    ax.grid(alpha=0.3)
    ax.legend()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
