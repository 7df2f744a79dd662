"""Ctrl-C and SIGTERM during training: finish the step, save, say how to resume, exit.

Schedulers (Slurm, Kubernetes) send SIGTERM some seconds before they kill a job; people press
Ctrl-C. Either way the loop should not die mid-step with the work since the last checkpoint lost.
The first signal only sets a flag: the loop finishes the optimizer step it is in, writes a
checkpoint and raises `TrainingInterrupted`, which the command line turns into the command that
resumes and exit status 128 + the signal number (130 for SIGINT, 143 for SIGTERM), the shell's
convention. A second signal means "now": it raises KeyboardInterrupt wherever the program is, so
the checkpoint being written (if any) is abandoned by its staging folder's cleanup and nothing that
looks complete is left behind.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class TrainingInterrupted(KeyboardInterrupt):
    """The run stopped on a signal after a whole step; `checkpoint` resumes it (None when no step
    had finished, so there is nothing to resume from)."""

    def __init__(self, signum: int, step: int, checkpoint: Path | None) -> None:
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        where = f"saved {checkpoint}" if checkpoint is not None else "no step had finished, nothing saved"
        super().__init__(f"stopped by {signal_name(signum)} after step {step}; {where}")

    @property
    def exit_status(self) -> int:
        return 128 + self.signum


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


def _say(text: str) -> None:
    """Write to stderr from a signal handler: with os.write, not print, since the handler may run
    while the main code is inside a write to sys.stderr (the progress bar), and a buffered stream
    refuses to be re-entered."""
    try:
        os.write(sys.stderr.fileno(), text.encode())
    except (AttributeError, OSError, ValueError):  # a stderr without a file descriptor
        print(text, end="", file=sys.stderr, flush=True)


class StopFlag:
    """Set by the first SIGINT/SIGTERM while installed; the second one raises KeyboardInterrupt."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.step = 0  # the step being run, for the message

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is None:
            self.signum = signum
            _say(f"\npagedrl: {signal_name(signum)} received: finishing step {self.step}, then saving a "
                 "checkpoint (send it again to stop at once, without saving)\n")
            return
        for s in SIGNALS:  # a third one gets Python's default behaviour
            signal.signal(s, signal.default_int_handler if s == signal.SIGINT else signal.SIG_DFL)
        self.signum = signum
        raise KeyboardInterrupt(f"{signal_name(signum)} received twice: stopped at once")

    @contextmanager
    def installed(self) -> Iterator[StopFlag]:
        """Handle SIGINT and SIGTERM inside the block (main thread only; elsewhere a no-op, since
        Python delivers signals to the main thread), restoring the previous handlers after."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {s: signal.getsignal(s) for s in SIGNALS}
        for s in SIGNALS:
            signal.signal(s, self._handle)
        try:
            yield self
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
