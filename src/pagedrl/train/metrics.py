"""Metrics that know how they combine: across micro-batches, ranks and the steps of a logging window.

A mean weighted by tokens where TRL weighs by tokens, a sum, a min or max, a running total
since the run began, or TRL's mean over micro-batches of each micro-batch's min (max) over the ranks;
tensors stay on their device until the window is logged.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import torch

from pagedrl.train.distributed import DistInfo, all_reduce_op

Reduce = Literal["mean", "sum", "min", "max", "cumulative", "micro_min", "micro_max"]
PER_MICRO_BATCH = ("micro_min", "micro_max")  # a list of values, one per micro-batch


@dataclass(frozen=True)
class Metric:
    """One metric contribution. `mean`: Σtotal / Σweight over micro-batches, ranks and the logged
    steps (weight = tokens for a token-weighted mean); `sum`: Σtotal; `min`/`max`; `cumulative`:
    Σtotal since the run began (TRL's `num_tokens`); `micro_min`/`micro_max`: each micro-batch's value,
    its min (max) over the ranks (NaN skipped, as TRL's `nanmin` skips it), averaged over the micro-batches
    of the logged steps, as TRL appends one value per micro-batch and logs their mean."""

    total: float | torch.Tensor | list  # a list: micro_min / micro_max values, one per micro-batch
    weight: float | torch.Tensor = 1.0
    reduce: Reduce = "mean"

    @classmethod
    def mean(cls, total: float | torch.Tensor, weight: float | torch.Tensor = 1.0) -> Metric:
        return cls(total, weight, "mean")

    @classmethod
    def sum(cls, total: float | torch.Tensor) -> Metric:
        return cls(total, 0.0, "sum")

    @classmethod
    def min(cls, value: float | torch.Tensor) -> Metric:
        return cls(value, 0.0, "min")

    @classmethod
    def max(cls, value: float | torch.Tensor) -> Metric:
        return cls(value, 0.0, "max")

    @classmethod
    def cumulative(cls, total: float | torch.Tensor) -> Metric:
        return cls(total, 0.0, "cumulative")

    @classmethod
    def micro_min(cls, value: float | torch.Tensor) -> Metric:
        return cls(value, 0.0, "micro_min")

    @classmethod
    def micro_max(cls, value: float | torch.Tensor) -> Metric:
        return cls(value, 0.0, "micro_max")


def as_metric(value: Metric | float | torch.Tensor) -> Metric:
    """A bare number is a plain mean over micro-batches."""
    return value if isinstance(value, Metric) else Metric.mean(value)


class MetricTotals:
    """Metrics combined under their rules: over a step's micro-batches, then across ranks, then
    over the steps of a logging window."""

    def __init__(self) -> None:
        self.items: dict[str, list] = {}  # name -> [reduce, total, weight]

    def add(self, name: str, metric: Metric | float | torch.Tensor) -> None:
        """Tensors stay tensors (no device sync per micro-batch) until `settle`."""
        m = as_metric(metric)
        if m.reduce in PER_MICRO_BATCH:  # one value per micro-batch (a list: a settled step's, being merged)
            values = [_detached(v) for v in (m.total if isinstance(m.total, list) else [m.total])]
            entry = self.items.setdefault(name, [m.reduce, [], 0.0])
            if entry[0] != m.reduce:
                raise ValueError(f"metric {name!r}: reduced as {entry[0]} and as {m.reduce} in one run")
            entry[1] = entry[1] + values
            return
        total, weight = _detached(m.total), _detached(m.weight)
        if name not in self.items:
            self.items[name] = [m.reduce, total, weight]
            return
        entry = self.items[name]
        if entry[0] != m.reduce:
            raise ValueError(f"metric {name!r}: reduced as {entry[0]} and as {m.reduce} in one run")
        if m.reduce in ("min", "max"):
            pick = torch.minimum if m.reduce == "min" else torch.maximum
            both = [torch.as_tensor(v, dtype=torch.float64) for v in (entry[1], total)]
            if both[0].device != both[1].device:
                both = [v.cpu() for v in both]
            entry[1] = pick(*both)
        else:
            entry[1] = entry[1] + total
            entry[2] = entry[2] + weight

    def settle(self) -> MetricTotals:
        """Turn every tensor into a float, with one transfer per device."""
        slots = [(entry, i) for entry in self.items.values() for i in (1, 2) if isinstance(entry[i], torch.Tensor)]
        slots += [(entry[1], i) for entry in self.items.values() if entry[0] in PER_MICRO_BATCH
                  for i, v in enumerate(entry[1]) if isinstance(v, torch.Tensor)]
        by_device: dict[torch.device, list] = {}
        for slot in slots:
            by_device.setdefault(slot[0][slot[1]].device, []).append(slot)
        for group in by_device.values():
            stacked = torch.stack([e[i].to(torch.float64).reshape(()) for e, i in group]).cpu().tolist()
            for (entry, i), value in zip(group, stacked, strict=True):
                entry[i] = value
        return self

    def merge(self, other: MetricTotals) -> None:
        for name, (reduce, total, weight) in other.settle().items.items():
            self.add(name, Metric(total, weight, reduce))

    def all_reduce(self, info: DistInfo) -> MetricTotals:
        """The same totals over every rank (every rank must report the same metric names)."""
        self.settle()
        if not info.distributed:
            return self
        names = sorted(self.items)
        out = MetricTotals()
        for op in ("sum", "min", "max"):
            chosen = [n for n in names if _op_of(self.items[n][0]) == op]
            if not chosen:
                continue
            flat = [v for n in chosen for v in (self.items[n][1], self.items[n][2])]
            reduced = all_reduce_op(flat, info, op).tolist()
            for i, n in enumerate(chosen):
                out.items[n] = [self.items[n][0], reduced[2 * i], reduced[2 * i + 1]]
        for reduce in PER_MICRO_BATCH:  # element-wise over ranks: every rank trains as many micro-batches
            chosen = [n for n in names if self.items[n][0] == reduce]
            if not chosen:
                continue
            skip = math.inf if reduce == "micro_min" else -math.inf  # NaN: nothing to measure, skipped
            flat = [skip if math.isnan(v) else v for n in chosen for v in self.items[n][1]]
            reduced = [math.nan if math.isinf(v) else v
                       for v in all_reduce_op(flat, info, reduce.removeprefix("micro_")).tolist()]
            start = 0
            for n in chosen:
                count = len(self.items[n][1])
                out.items[n] = [reduce, reduced[start:start + count], 0.0]
                start += count
        return out

    def values(self, running: Mapping[str, float] | None = None) -> dict[str, float]:
        """Final numbers; a `cumulative` metric reads from `running` (totals since the start)."""
        self.settle()
        out = {}
        for name, (reduce, total, weight) in self.items.items():
            if reduce == "mean":
                out[name] = total / weight if weight else float("nan")
            elif reduce in PER_MICRO_BATCH:
                out[name] = sum(total) / len(total) if total else float("nan")
            elif reduce == "cumulative":
                out[name] = (running or {}).get(name, total)
            else:
                out[name] = total
        return out

    def state_dict(self) -> dict[str, list]:
        return {k: [v[0], list(v[1]) if isinstance(v[1], list) else v[1], v[2]] for k, v in self.settle().items.items()}

    def load_state_dict(self, state: Mapping[str, list]) -> None:
        self.items = {k: [v[0], list(v[1]) if isinstance(v[1], list) else v[1], v[2]] for k, v in state.items()}


def _op_of(reduce: str) -> str:
    return reduce if reduce in ("min", "max", *PER_MICRO_BATCH) else "sum"


def _detached(x: float | torch.Tensor) -> float | torch.Tensor:
    return x.detach() if isinstance(x, torch.Tensor) else float(x)
