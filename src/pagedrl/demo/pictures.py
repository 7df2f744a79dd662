"""The report's PNGs: the KV cache at one moment (paged blocks beside contiguous allocations) and
held-out accuracy against training minutes for the three methods. Each is drawn from numbers the
run wrote (a KV snapshot, metrics.jsonl rows), never from constants."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

COLUMNS = 16  # blocks per row of the block grid


def _colour(request: int) -> Any:
    return plt.get_cmap("tab20")(request % 20)


def kv_picture(snapshot: dict[str, Any], path: Path) -> Path:
    """Left: physical blocks coloured by the request owning them, shared blocks hatched and
    outlined, free blocks blank. Right: the same sequences as contiguous allocations of prompt +
    max_tokens each, live tokens coloured and the reserved-but-empty rest shaded."""
    seqs, num_blocks, bs = snapshot["seqs"], snapshot["num_blocks"], snapshot["block_size"]
    owner: dict[int, int] = {}
    count: dict[int, int] = {}
    for s in seqs:
        for b in s["blocks"]:
            owner.setdefault(b, s["request"])
            count[b] = count.get(b, 0) + 1
    rows = -(-num_blocks // COLUMNS)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, max(3.5, 0.3 * max(rows, len(seqs)) + 1.5)), dpi=90)
    for b in range(num_blocks):
        x, y = b % COLUMNS, rows - 1 - b // COLUMNS
        if b in owner:
            shared = count[b] > 1
            left.add_patch(Rectangle((x, y), 0.92, 0.92, facecolor=_colour(owner[b]), hatch="///" if shared else None,
                                     edgecolor="black" if shared else "none", linewidth=1.2 if shared else 0))
        else:
            left.add_patch(Rectangle((x, y), 0.92, 0.92, facecolor="white", edgecolor="#cccccc", linewidth=0.5))
    used, shared_blocks = len(owner), sum(1 for k in count.values() if k > 1)
    left.set_xlim(0, COLUMNS)
    left.set_ylim(0, rows)
    left.set_aspect("equal")
    left.axis("off")
    left.set_title(f"pagedrl: {used} of {num_blocks} blocks of {bs} tokens held, coloured by request\n"
                   f"({shared_blocks} shared by several sequences, hatched; free blocks blank)", fontsize=9)
    reserved = sum(s["reserved_tokens"] for s in seqs)
    live = sum(s["live_tokens"] for s in seqs)
    copies = 0
    for i, s in enumerate(seqs):
        y = len(seqs) - 1 - i
        right.barh(y, s["live_tokens"], color=_colour(s["request"]), height=0.8)
        if s["sample"] > 0:  # a sample of an n-sample request: its own copy of the shared prompt
            copy = min(s["prompt_tokens"], s["live_tokens"])
            copies += copy
            right.barh(y, copy, color="white", alpha=0.55, hatch="xx", edgecolor="black", linewidth=0, height=0.8)
        right.barh(y, s["reserved_tokens"] - s["live_tokens"], left=s["live_tokens"], color="#dddddd",
                   hatch="..", edgecolor="#999999", linewidth=0, height=0.8)
    right.set_yticks([])
    right.set_xlabel("tokens")
    right.set_title(f"contiguous per-sequence allocations (prompt + max_tokens each):\n{reserved} slots, "
                    f"{1 - live / max(reserved, 1):.0%} reserved but empty (dotted),\n{copies} holding copies of a "
                    "prompt another sample already holds (crossed)", fontsize=9)
    fig.suptitle(f"The KV cache at step {snapshot['step']}, the step that held the most blocks", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def accuracy_picture(curves: dict[str, list[tuple[float, float]]], bounds: dict[str, list[tuple[float, float]]],
                     path: Path, num_eval: int) -> Path:
    """One line per method: (training minutes, held-out accuracy) points, each with its 95%
    interval as an error bar (methods nudged apart sideways so the bars do not hide each other)."""
    fig, ax = plt.subplots(figsize=(6.5, 4), dpi=100)
    span = max((x for points in curves.values() for x, _ in points), default=1.0) or 1.0
    for i, (name, points) in enumerate(curves.items()):
        xs, ys = zip(*points, strict=True)
        xs = tuple(x + (i - 1) * 0.006 * span for x in xs)
        low = [y - lo for y, (lo, _) in zip(ys, bounds[name], strict=True)]
        high = [hi - y for y, (_, hi) in zip(ys, bounds[name], strict=True)]
        ax.errorbar(xs, ys, yerr=[low, high], marker="o", markersize=4, capsize=3, label=name)
    ax.set_xlabel("training minutes (evaluations excluded; RLHF's include its reward model)")
    ax.set_ylabel(f"held-out accuracy ({num_eval} problems, greedy)")
    ax.set_title("GRPO vs DPO vs RLHF, same model and budget (bars: 95% intervals)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def throughput_picture(paged: dict[str, Any], path: Path) -> Path:
    """Output tokens/s and the share of KV slots holding live tokens, pagedrl against static batches."""
    fig, (a, b) = plt.subplots(1, 2, figsize=(8, 3), dpi=100)
    names = ["transformers\n(static batches)", "pagedrl"]
    a.bar(names, [paged["transformers_output_tps"], paged["pagedrl_output_tps"]], color=["#999999", "#1f77b4"])
    a.set_title(f"output tokens/s ({paged['throughput_ratio']:.2f}x)", fontsize=10)
    b.bar(names, [100 * paged["transformers_kv_utilisation"], 100 * paged["pagedrl_kv_utilisation"]],
          color=["#999999", "#1f77b4"])
    b.set_ylim(0, 100)
    b.set_title("KV slots holding live tokens (%)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
