"""Skips for tests of a hardware path: each asks the probe the engine asks (`pagedrl.kernels.isa`)
and names the class it needs and the class this process runs as (a `PAGEDRL_CPU_ISA` cap included),
so a skip is never silent and never happens on the class the test is about."""

from __future__ import annotations

import pytest

from pagedrl.kernels import isa


def needs(name: str, what: str) -> None:
    """Skip unless this process may use the instructions of CPU class `name`."""
    if not isa.at_least(name):
        pytest.skip(f"{what} needs a CPU of class {name} ({isa.DESCRIPTIONS[name]}) or above; "
                    f"this one runs as {isa.describe()}")


def needs_not(name: str, what: str) -> None:
    """Skip where the CPU has class `name` (a path for the classes below it)."""
    if isa.at_least(name):
        pytest.skip(f"{what} is for CPUs below class {name}; this one runs as {isa.describe()}")
