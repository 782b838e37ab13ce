"""Ctrl-C while vLLM's worker processes run a step (tensor parallelism, or any engine whose
workers are processes of their own).

A Ctrl-C in a terminal, or a notebook's "interrupt the kernel", sends SIGINT to every process of
the user's process group, vLLM's workers included, and they exit on it: the engine is gone. So
each worker process ignores SIGINT (``WorkerRuntime.leave_interrupts_to_the_user``) and the
user's process stops the call.

It must not stop it in the middle of a wait for the workers' answer either: vLLM's executor reads
answers in the order it asked, and an answer left unread would be read as the next question's.
So while the user's process waits on the workers, :class:`WorkerWaits` holds a Ctrl-C and raises
it once the answer is in, at most one step later (the engine then aborts the call's requests, see
``Engine.abort_unfinished``). A second Ctrl-C in the same wait is raised at once, for a worker
that never answers; that engine cannot be used again (:attr:`WorkerWaits.lost_answer`).
"""

from __future__ import annotations

import signal
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

SignalHandler = Callable[[int, FrameType | None], Any]


class WorkerWaits:
    """Holds a Ctrl-C while this process waits on worker processes (see the module's docstring)."""

    def __init__(self) -> None:
        #: a second Ctrl-C stopped a wait: an answer of the workers was never read
        self.lost_answer = False
        self._previous: SignalHandler | None = None  # the handler a wait replaced
        self._held: tuple[int, FrameType | None] | None = None

    @contextmanager
    def wait(self) -> Iterator[None]:
        """Hold SIGINT until the block ends, then hand it to the handler that was there before
        (Python's raises KeyboardInterrupt). Only the main thread receives signals; elsewhere,
        inside another wait, or where SIGINT is ignored, the block runs as it is."""
        previous = signal.getsignal(signal.SIGINT)
        if (
            self._previous is not None
            or not callable(previous)
            or threading.current_thread() is not threading.main_thread()
        ):
            yield
            return
        self._previous = previous
        signal.signal(signal.SIGINT, self._hold)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)
            held, self._held, self._previous = self._held, None, None
            if held is not None:
                previous(*held)

    def _hold(self, signum: int, frame: FrameType | None) -> None:
        if self._held is None:
            self._held = (signum, frame)
            return
        self.lost_answer = True
        self._held = None  # raised now, not again when the wait ends
        assert self._previous is not None
        self._previous(signum, frame)


def step_whole_steps(llm_engine: Any, waits: WorkerWaits) -> None:
    """Let a Ctrl-C stop ``llm_engine``'s calls only between steps (see :mod:`vlens.engine.interrupts`):
    its ``step`` runs inside ``waits.wait()``."""
    step = type(llm_engine).step
    engine = weakref.ref(llm_engine)  # the engine holds the wrapper: no reference cycle

    def whole_step() -> Any:
        with waits.wait():
            return step(engine())

    llm_engine.step = whole_step
