"""An engine's processes leave with the process that started them.

vLLM's engine core and worker processes outlive a parent killed with SIGKILL (a supervisor, the
OOM killer): they hold the model's memory and, under ``vlens serve``, the port. While vlens
builds an engine, :data:`WATCHED` names the process building it; every vLLM process started then
loads :func:`watch_parent` (vlens's entry in ``vllm.general_plugins``), which, in any process but
that one, watches its own parent and, once the parent is gone, stops the process: SIGTERM (vLLM's
own shutdown, which stops its workers), then SIGKILL if it is still running.
"""

from __future__ import annotations

import os
import signal
import threading
import time

#: The environment variable naming the process that builds the engine.
WATCHED = "VLENS_ENGINE_OWNER"

#: Seconds between looks at the parent, and granted to vLLM's shutdown before SIGKILL.
POLL_SECONDS = 0.5
GRACE_SECONDS = 5.0

_watching_in: int | None = None  # the process whose watch runs (a forked child has none)


def watch_parent() -> None:
    """vLLM loads this in each of its processes (and more than once in some)."""
    global _watching_in
    owner = os.environ.get(WATCHED)
    if _watching_in == os.getpid() or owner is None or owner == str(os.getpid()):
        return
    _watching_in = os.getpid()
    threading.Thread(target=_watch, args=(os.getppid(),), daemon=True,
                     name="vlens-parent-watch").start()


def _watch(parent: int) -> None:
    while os.getppid() == parent:  # a child whose parent died is handed to another
        time.sleep(POLL_SECONDS)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(GRACE_SECONDS)
    os.kill(os.getpid(), signal.SIGKILL)
