"""Learning-rate schedules: transformers 5's `SchedulerType`s that need no metric, with their
`lr_scheduler_kwargs`, as multipliers of the peak learning rate at each optimizer step.

Each multiplier is written as transformers 5.24's `optimization.py` writes it (the same operations
in the same order), so the rate at every step equals `transformers.get_scheduler` on the same
optimizer. `reduce_lr_on_plateau` and `greedy` follow a metric the loop would have to feed them and
are refused. The options are checked when the config loads, so a misspelt key or a text where a
number belongs fails at start-up naming `lr_scheduler_kwargs.<key>`, not as a TypeError inside a
schedule function (which is where transformers finds it).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from pagedrl.train.config_values import MISSING, coerce

# Each schedule -> its lr_scheduler_kwargs, as the arguments of its transformers function that
# get_scheduler passes on (`constant` and `constant_with_warmup` are given none of them there).
OPTIONS: dict[str, dict[str, type]] = {
    "linear": {},
    "cosine": {"num_cycles": float},
    "cosine_with_restarts": {"num_cycles": int},
    "polynomial": {"lr_end": float, "power": float},
    "constant": {},
    "constant_with_warmup": {},
    "inverse_sqrt": {"timescale": int},
    "cosine_with_min_lr": {"num_cycles": float, "min_lr": float, "min_lr_rate": float},
    "cosine_warmup_with_min_lr": {"num_cycles": float, "min_lr": float, "min_lr_rate": float, "warmup_lr_rate": float},
    "warmup_stable_decay": {"num_decay_steps": int, "num_stable_steps": int, "warmup_type": str, "decay_type": str,
                            "min_lr_ratio": float, "num_cycles": float},
}
SCHEDULES = tuple(OPTIONS)
NEED_A_METRIC = ("reduce_lr_on_plateau", "greedy")
# Schedules whose warm-up is not the plain s / w ramp that `warmup_starts_at_zero: false` replaces.
OWN_WARMUP = {"cosine_warmup_with_min_lr": "its warm-up starts at warmup_lr_rate (1/w when unset)",
              "warmup_stable_decay": "its warm-up starts at min_lr_ratio and follows warmup_type"}
SHAPES = ("linear", "cosine", "1-sqrt")  # warmup_stable_decay's warmup_type and decay_type
UNIT = ("min_lr_rate", "warmup_lr_rate", "min_lr_ratio")  # ratios of the peak: in [0, 1]


class ScheduleError(ValueError):
    """A schedule setting pagedrl cannot run; `key` names the field (`lr_scheduler_kwargs.<key>`)."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key, self.message = key, message


def _accepted(kind: str) -> str:
    keys = OPTIONS[kind]
    return f"{kind} takes " + (", ".join(keys) if keys else "no lr_scheduler_kwargs")


def check_schedule(kind: str, options: dict[str, Any], learning_rate: float, has_warmup: bool,
                   from_zero: bool) -> dict[str, Any]:
    """`options` read for `kind` (ints where a float is expected become floats), or a ScheduleError
    naming the field: an unknown schedule, a key `kind` does not take, a value of the wrong type or
    range, or a warm-up `warmup_starts_at_zero: false` cannot change."""
    if kind in NEED_A_METRIC:
        raise ScheduleError("lr_scheduler_type", f"{kind} follows a metric each step; pagedrl's schedules are set by "
                                                 f"the step alone: use one of {', '.join(SCHEDULES)}")
    if kind not in OPTIONS:
        raise ScheduleError("lr_scheduler_type", f"expected one of {', '.join(SCHEDULES)}, got {kind!r}")
    if not from_zero and has_warmup and kind in OWN_WARMUP:
        raise ScheduleError("warmup_starts_at_zero", f"false cannot apply to {kind}: {OWN_WARMUP[kind]}; leave it "
                                                     "true, or use cosine_with_min_lr")
    out: dict[str, Any] = {}
    for key, value in options.items():
        name = f"lr_scheduler_kwargs.{key}"
        if key not in OPTIONS[kind]:
            raise ScheduleError(name, f"not an option of {kind}; {_accepted(kind)}")
        hint = OPTIONS[kind][key]
        got = coerce(value, hint)
        if got is MISSING or (isinstance(got, float) and not math.isfinite(got)):
            raise ScheduleError(name, f"expected {'an integer' if hint is int else 'a number' if hint is float else 'text'}"
                                      f", got {value!r}")
        out[key] = got
    for key, value in out.items():
        name = f"lr_scheduler_kwargs.{key}"
        if key in UNIT and not 0.0 <= value <= 1.0:
            raise ScheduleError(name, f"a ratio of the peak learning rate: must lie in [0, 1], got {value}")
        if key in ("warmup_type", "decay_type") and value not in SHAPES:
            raise ScheduleError(name, f"expected one of {', '.join(SHAPES)}, got {value!r}")
        if key in ("num_cycles", "timescale", "power") and value <= 0:
            raise ScheduleError(name, f"must be > 0, got {value}")
        if key in ("num_decay_steps", "num_stable_steps", "lr_end", "min_lr") and value < 0:
            raise ScheduleError(name, f"must be >= 0, got {value}")
    if "min_lr" in OPTIONS[kind] and ("min_lr" in out) == ("min_lr_rate" in out):
        raise ScheduleError("lr_scheduler_kwargs", f"{kind} needs exactly one of min_lr or min_lr_rate (as in "
                                                   f"transformers), got {', '.join(out) or 'neither'}")
    if kind == "warmup_stable_decay" and "num_decay_steps" not in out:
        raise ScheduleError("lr_scheduler_kwargs", "warmup_stable_decay needs num_decay_steps (as in transformers)")
    if ("min_lr" in out or kind == "polynomial") and learning_rate <= 0:
        raise ScheduleError("learning_rate", f"must be > 0 for {kind}'s end rate, got {learning_rate}")
    if kind == "polynomial" and not learning_rate > out.get("lr_end", 1e-7):
        raise ScheduleError("lr_scheduler_kwargs.lr_end", f"must be below learning_rate ({learning_rate}), got "
                                                          f"{out.get('lr_end', 1e-7)} (1e-7 when unset)")
    return out


def _warmup(step: int, warmup: int) -> float:  # transformers' ramp: 0 at the first step
    return float(step) / float(max(1, warmup))


def _cosine(step: int, warmup: int, total: int, num_cycles: float, min_lr_rate: float = 0.0) -> float:
    progress = float(step - warmup) / float(max(1, total - warmup))
    factor = 0.5 * (1.0 + math.cos(math.pi * float(num_cycles) * 2.0 * progress))
    return max(0, factor * (1 - min_lr_rate) + min_lr_rate) if min_lr_rate else max(0.0, factor)


def _restarts(step: int, warmup: int, total: int, num_cycles: int = 1) -> float:
    progress = float(step - warmup) / float(max(1, total - warmup))
    if progress >= 1.0:
        return 0.0
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * ((float(num_cycles) * progress) % 1.0))))


def _polynomial(step: int, warmup: int, total: int, lr_init: float, lr_end: float = 1e-7, power: float = 1.0) -> float:
    decay_steps = total - warmup
    if step > total or decay_steps <= 0:  # (transformers divides by zero when the warm-up is the whole run)
        return lr_end / lr_init
    pct_remaining = 1 - (step - warmup) / decay_steps
    return ((lr_init - lr_end) * pct_remaining**power + lr_end) / lr_init


def _wsd(step: int, warmup: int, total: int, num_decay_steps: int, num_stable_steps: int | None = None,
         warmup_type: str = "linear", decay_type: str = "cosine", min_lr_ratio: float = 0.0,
         num_cycles: float = 0.5) -> float:
    stable = total - warmup - num_decay_steps if num_stable_steps is None else num_stable_steps
    if step < warmup:
        progress = float(step) / float(max(1, warmup))
        factor = (progress if warmup_type == "linear" else 0.5 * (1.0 - math.cos(math.pi * progress))
                  if warmup_type == "cosine" else 1.0 - math.sqrt(1.0 - progress))
        return max(0.0, factor * (1.0 - min_lr_ratio) + min_lr_ratio)
    if step < warmup + stable:
        return 1.0
    if step < warmup + stable + num_decay_steps:
        progress = float(step - warmup - stable) / float(max(1, num_decay_steps))
        factor = (1.0 - progress if decay_type == "linear" else
                  0.5 * (1.0 + math.cos(math.pi * float(num_cycles) * 2.0 * progress)) if decay_type == "cosine"
                  else 1.0 - math.sqrt(progress))
        return max(0.0, factor * (1.0 - min_lr_ratio) + min_lr_ratio)
    return min_lr_ratio


def _cosine_warmup_min_lr(step: int, warmup: int, total: int, min_lr_rate: float, num_cycles: float = 0.5,
                          warmup_lr_rate: float | None = None) -> float:
    s, w, t = float(step), float(warmup), float(total)
    if s < w:
        if warmup_lr_rate is None:
            return (s + 1.0) / max(1.0, w)
        return warmup_lr_rate + (1.0 - warmup_lr_rate) * s / max(1, w - 1)
    progress = (s - w + 1.0) / max(1.0, t - w)
    factor = 0.5 * (1.0 + math.cos(math.pi * num_cycles * 2.0 * progress))
    return max(0, factor * (1 - min_lr_rate) + min_lr_rate)


def lr_lambda(kind: str, warmup: int, total: int, from_zero: bool = True, options: dict[str, Any] | None = None,
              learning_rate: float = 1.0) -> Callable[[int], float]:
    """Multiplier of the peak learning rate at step s (0-based) for transformers' schedule `kind`
    with `options` (its lr_scheduler_kwargs), `warmup` warm-up steps of `total`, and `learning_rate`
    the peak (min_lr and polynomial's lr_end are rates, the multiplier their ratio to it).
    transformers' `constant` has no warm-up whatever `warmup` says (`constant_with_warmup` has one).
    `from_zero` False: a plain linear warm-up's steps train at 1/(warmup+1) .. warmup/(warmup+1)
    instead of 0 .. (warmup-1)/warmup (`TrainConfig.warmup_starts_at_zero`)."""
    opts = check_schedule(kind, dict(options or {}), learning_rate, warmup > 0, from_zero)
    if kind == "constant":
        warmup = 0
    if "min_lr" in opts:
        opts["min_lr_rate"] = opts.pop("min_lr") / learning_rate
    if kind == "warmup_stable_decay" and "num_stable_steps" not in opts and warmup + opts["num_decay_steps"] > total:
        raise ScheduleError("lr_scheduler_kwargs.num_decay_steps", f"{opts['num_decay_steps']} decay steps after "
                            f"{warmup} warm-up steps do not fit the run's {total} steps")
    after: Callable[[int], float] = {
        "linear": lambda s: max(0.0, float(total - s) / float(max(1, total - warmup))),
        "cosine": lambda s: _cosine(s, warmup, total, opts.get("num_cycles", 0.5)),
        "cosine_with_restarts": lambda s: _restarts(s, warmup, total, **opts),
        "polynomial": lambda s: _polynomial(s, warmup, total, learning_rate, **opts),
        "constant": lambda s: 1.0,
        "constant_with_warmup": lambda s: 1.0,
        "inverse_sqrt": lambda s: 1.0 / math.sqrt((s + timescale - warmup) / timescale),
        "cosine_with_min_lr": lambda s: _cosine(s, warmup, total, opts.get("num_cycles", 0.5), opts["min_lr_rate"]),
        "cosine_warmup_with_min_lr": lambda s: _cosine_warmup_min_lr(s, warmup, total, **opts),
        "warmup_stable_decay": lambda s: _wsd(s, warmup, total, **opts),
    }[kind]
    timescale = opts.get("timescale", warmup or 10_000)

    def f(step: int) -> float:
        if step < warmup and kind not in OWN_WARMUP:
            return _warmup(step, warmup) if from_zero else (step + 1) / (warmup + 1)
        return after(step)

    return f
