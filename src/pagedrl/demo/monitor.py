"""One progress line for the whole demo, and each stage's peak memory.

A background thread wakes twice a second: it samples the process's resident memory (the stage's
peak is the largest sample; on CUDA the allocator's own peak is used instead) and redraws the line:
the stage, its step, training time against the budget, the latest held-out accuracy and an ETA
for the whole demo (the plan's estimate of what is left, corrected as stages finish). Stages'
own printing goes to their log files, so nothing tears the line.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch


def rss_bytes() -> int:
    """Resident memory of this process now (Linux), else its peak so far."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


def last_rows(metrics: Path) -> tuple[int, float | None, float | None]:
    """(last step, last train_time, last eval/accuracy) of a metrics.jsonl being written."""
    step, train, acc = 0, None, None
    try:
        text = metrics.read_text(encoding="utf-8")
    except OSError:
        return step, train, acc
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line being written
        step = max(step, int(row.get("step", 0)))
        train = row.get("train_time", train)
        acc = row.get("eval/accuracy", acc)
    return step, train, acc


class Monitor:
    def __init__(self, total_estimate: float, enabled: bool = True, interval: float = 0.5) -> None:
        self.interval, self.enabled = interval, enabled
        self.start = time.perf_counter()
        self.estimate = total_estimate  # seconds the whole demo is expected to take
        self.stage, self.index, self.count = "", 0, 0
        self.metrics: Path | None = None
        self.budget: float | None = None
        self.max_steps: int | None = None
        self.peak = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._bar: Any = None
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=max(1, round(total_estimate)), unit="s", file=sys.stderr, dynamic_ncols=True,
                             bar_format="{desc} |{bar:16}|")
        self._thread.start()

    def begin(self, stage: str, index: int, count: int, metrics: Path | None = None,
              budget_seconds: float | None = None, max_steps: int | None = None) -> None:
        """A stage starts; a trained one shows its step against `max_steps` (a step budget) or its
        training time against `budget_seconds`."""
        with self._lock:
            self.stage, self.index, self.count = stage, index, count
            self.metrics, self.budget, self.max_steps = metrics, budget_seconds, max_steps
            self.peak = rss_bytes()
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()

    def end(self, remaining_estimate: float) -> int:
        """The stage's peak memory in bytes; the ETA now assumes `remaining_estimate` seconds more."""
        with self._lock:
            self.estimate = time.perf_counter() - self.start + remaining_estimate
            if torch.cuda.is_available():
                return int(torch.cuda.max_memory_allocated())
            return max(self.peak, rss_bytes())

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            with self._lock:
                self.peak = max(self.peak, rss_bytes())
                self._draw()

    def _draw(self) -> None:
        if self._bar is None:
            return
        elapsed = time.perf_counter() - self.start
        parts = []
        if self.metrics is not None:
            step, train, acc = last_rows(self.metrics)
            parts.append(f"step {step}/{self.max_steps}" if self.max_steps else f"step {step}")
            if train is not None and self.budget:
                parts.append(f"trained {train / 60:.1f}/{self.budget / 60:.1f} min")
            elif train is not None:
                parts.append(f"trained {train / 60:.1f} min")
            if acc is not None:
                parts.append(f"accuracy {acc:.3f}")
        self._bar.total = max(round(self.estimate), round(elapsed) + 1)
        self._bar.n = round(elapsed)
        left = max(0.0, self.estimate - elapsed)
        parts.append(f"{elapsed / 60:.1f} min, about {left / 60:.1f} min left" if left else f"{elapsed / 60:.1f} min")
        self._bar.set_description_str(f"demo [{self.index}/{self.count}] {self.stage}: " + ", ".join(parts),
                                      refresh=False)
        self._bar.refresh()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        if self._bar is not None:
            self._bar.close()
