"""Where a run's numbers go: `metrics.jsonl` (one object per logged step, TRL's names), TensorBoard
event files, a progress bar with ETA, and PNG plots of the curves when the run ends. Online
algorithms also leave a few sample completions per logged step in `completions.jsonl` and as a
TensorBoard text table (TRL's `log_completions`), since a reward curve alone does not say what
the policy is learning to write. Each held-out evaluation also leaves its per-problem scores in
`eval_outcomes.jsonl` (in the evaluation set's order), so an accuracy can be recomputed, given an
interval, or compared problem by problem with another run's.

Only rank 0 builds a `RunLogger` that writes; the others get one with `enabled=False`, so the
loop never asks which rank it is on before logging.
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"
COMPLETIONS_FILE = "completions.jsonl"
EVAL_OUTCOMES_FILE = "eval_outcomes.jsonl"
PLOTS_DIR = "plots"
# Columns that are bookkeeping, not curves worth a plot.
NOT_PLOTTED = {"step", "epoch", "wall_time", "train_time"}


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl file; a line that is not JSON is a ValueError naming the file
    and the line."""
    path = Path(path)
    rows = []
    with path.open(encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number}: not a JSON row ({e.msg} at column {e.colno})") from None
    return rows


def truncate_metrics(path: Path, last_step: int) -> list[str]:
    """Drop rows after `last_step`: a resumed run rewrites the steps after its checkpoint, and
    the file must not hold them twice. A last line cut off mid-write (the process was killed)
    is dropped too; a bad line before the end is an error naming it. Returns what was dropped,
    for the start summary."""
    if not path.is_file():
        return []
    lines = path.read_bytes().decode("utf-8", errors="replace").splitlines()
    while lines and not lines[-1].strip():
        lines.pop()
    notes, kept, later = [], [], 0
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            if number < len(lines):
                raise ValueError(f"{path}:{number}: not a JSON row ({e.msg} at column {e.colno}); "
                                 "fix or delete that line to resume") from None
            notes.append(f"{path}: dropped its last line {number}, cut off mid-write ({line[:40]!r}...)")
            continue
        if isinstance(row, dict) and row.get("step", 0) <= last_step:
            kept.append(row)
        else:
            later += 1
    if later:
        notes.append(f"{path}: dropped {later} row(s) after step {last_step}; the resumed run writes them again")
    if notes:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(json.dumps(row) + "\n" for row in kept), encoding="utf-8")
        tmp.replace(path)
    return notes


class RunLogger:
    """Appends metric rows to metrics.jsonl and TensorBoard, drives the progress bar."""

    def __init__(self, output_dir: str | Path, report_to: Iterable[str] = ("jsonl",), enabled: bool = True,
                 total_steps: int = 0, initial_step: int = 0, resume_step: int | None = None,
                 progress: bool = True) -> None:
        self.output_dir = Path(output_dir)
        self.enabled = enabled
        report_to = set(report_to)
        self.metrics_path = self.output_dir / METRICS_FILE
        self.completions_path = self.output_dir / COMPLETIONS_FILE
        self.outcomes_path = self.output_dir / EVAL_OUTCOMES_FILE
        self._jsonl = None
        self._tb = None
        self._bar = None
        self._progress = (progress, total_steps, initial_step)
        self.notes: list[str] = []  # what opening the log changed (rows dropped on resume)
        if not enabled:
            return
        self.output_dir.mkdir(parents=True, exist_ok=True)
        if "jsonl" in report_to:
            for path in (self.metrics_path, self.completions_path, self.outcomes_path):
                if resume_step is None:
                    path.unlink(missing_ok=True)
                else:
                    self.notes += truncate_metrics(path, resume_step)
            self._jsonl = self.metrics_path.open("a", encoding="utf-8")
        if "tensorboard" in report_to:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(logdir=str(self.output_dir / "runs"), purge_step=resume_step)

    def start_progress(self) -> None:
        """Show the progress bar (after the start summary, so the two do not interleave)."""
        show, total, initial = self._progress
        if self.enabled and show and self._bar is None:
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True,
                             file=sys.stderr)

    def log(self, row: Mapping[str, Any]) -> None:
        """Write one row (it must hold `step`); non-finite numbers are written as null in JSON."""
        if not self.enabled:
            return
        clean = {k: _jsonable(v) for k, v in row.items()}
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(clean) + "\n")
            self._jsonl.flush()
        if self._tb is not None:
            step = int(row["step"])
            for key, value in row.items():
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tb.add_scalar(key if "/" in key else f"train/{key}", value, step)
            self._tb.flush()
        if self._bar is not None and "loss" in row:
            self._bar.set_postfix(loss=f"{row['loss']:.4g}", refresh=False)

    def log_completions(self, step: int, rows: list[dict[str, Any]]) -> None:
        """Sample completions of one step: appended to completions.jsonl (with the step) and shown
        in TensorBoard as a text table."""
        if not self.enabled or not rows:
            return
        with self.completions_path.open("a", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps({"step": step, **{k: _jsonable(v) for k, v in row.items()}}) + "\n")
        if self._tb is not None:
            columns = list(rows[0])
            table = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
            table += ["| " + " | ".join(_cell(r.get(c, "")) for c in columns) + " |" for r in rows]
            self._tb.add_text("completions", "\n".join(table), step)
            self._tb.flush()

    def log_eval_outcomes(self, step: int, outcomes: list[float]) -> None:
        """One evaluation's per-problem scores (NaN, written as null: not applicable)."""
        if not self.enabled or self._jsonl is None:
            return
        with self.outcomes_path.open("a", encoding="utf-8") as f:
            f.write(json.dumps({"step": step, "outcomes": [_jsonable(float(v)) for v in outcomes]}) + "\n")

    def advance(self, steps: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(steps)

    def write(self, text: str) -> None:
        """A message that does not tear the progress bar (rank 0 only)."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text, file=sys.stdout)
        else:
            print(text, flush=True)

    def close(self, plot: bool = True) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
            if plot:
                plot_metrics(self.metrics_path, self.output_dir / PLOTS_DIR)


def _cell(value: Any) -> str:
    """A Markdown table cell: numbers short, no line breaks or column bars inside."""
    text = f"{value:.4g}" if isinstance(value, float) else str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def plot_metrics(metrics_path: str | Path, out_dir: str | Path) -> list[Path]:
    """One PNG per numeric metric against step. Returns the files written."""
    path = Path(metrics_path)
    if not path.is_file():
        return []
    rows = read_metrics(path)
    series: dict[str, tuple[list[float], list[float]]] = {}
    for row in rows:
        for key, value in row.items():
            if key in NOT_PLOTTED or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            xs, ys = series.setdefault(key, ([], []))
            xs.append(row["step"])
            ys.append(value)
    if not series:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for key, (xs, ys) in series.items():
        fig, ax = plt.subplots(figsize=(5, 3.2), dpi=100)
        ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3)
        ax.set_xlabel("step")
        ax.set_title(key)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        target = out / (re.sub(r"[^A-Za-z0-9_.-]+", "_", key) + ".png")
        fig.savefig(target)
        plt.close(fig)
        written.append(target)
    return written
