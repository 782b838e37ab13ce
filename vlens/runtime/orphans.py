"""A worker process that outlives the user's process exits.

vLLM's worker processes wait for work in a shared-memory queue, polling it; when the user's
process is killed from outside (a ``timeout``, a SIGKILL, a crashed notebook kernel) nothing tells
them, and each goes on polling at a good part of a core until someone kills it. vlens watches the
parent from a thread of each worker process: once the parent is gone (the worker has been handed
to another process), the files the worker wrote for a reader that will never come are removed and
the worker exits. Its shared host blocks (:mod:`vlens.runtime.transfer.host_blocks`) are memory files with
no name, freed with the process.
"""

from __future__ import annotations

import os
import threading
import time

from vlens.runtime.transfer import shared_tensors

INTERVAL = 1.0


def exit_with_parent() -> None:
    """In a worker process: exit once the process that started it is gone. Once per process."""
    if any(thread.name == _THREAD for thread in threading.enumerate()):
        return
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(INTERVAL)
        shared_tensors.remove_written()
        os._exit(1)

    threading.Thread(target=watch, name=_THREAD, daemon=True).start()


_THREAD = "vlens-parent-watch"
