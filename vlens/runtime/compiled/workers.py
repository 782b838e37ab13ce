"""vLLM workers that install the compiled engine's traced hooks right after loading the model.

A compiled engine's hooks must be on the model before vLLM's first forward, which compiles it
(:mod:`vlens.runtime.compiled.graph`); vLLM runs that forward while the engine is built, inside each
worker, before anything from the user's process reaches the workers. So a compiled engine is
built with ``worker_cls`` naming one of the classes below (vLLM imports it by name in every
worker process, whether it forks or spawns them): its ``load_model`` loads as vLLM's own worker
does, then installs the declared names, which the user's process left in a file named by
:data:`GRAPH_NAMES_FILE` in the environment the workers inherit.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import cloudpickle

from vlens.runtime.compiled.breaks import segment_graphs_at_hook_sites
from vlens.runtime.compiled.graph import GraphName, install_graph_sites
from vlens.runtime.compiled.hook_sites import active_sites
from vlens.runtime.compiled.inline import InlineRequests
from vlens.runtime.worker import GRAPH_ATTRIBUTE, RUNTIME_ATTRIBUTE, runtime_of

#: The environment variable naming the file of the graph names (set while an engine is built).
GRAPH_NAMES_FILE = "VLENS_GRAPH_NAMES_FILE"


class InstallsGraphSites:
    """Mixed in before vLLM's worker class: loads the model, then installs the graph names."""

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        from vllm.platforms import current_platform

        super().load_model(*args, **kwargs)  # type: ignore[misc]
        path = os.environ.get(GRAPH_NAMES_FILE)
        if path is None:
            raise RuntimeError(
                f"a vlens graph worker started without {GRAPH_NAMES_FILE}: build compiled "
                f"engines with HookedVLLM.from_pretrained(..., compiled_capture=...)"
            )
        names = cloudpickle.loads(Path(path).read_bytes())  # written by the user's own process
        sites = install_graph_sites(self.model_runner, names)  # type: ignore[attr-defined]
        setattr(self, GRAPH_ATTRIBUTE, sites)
        if sites.hook_sites and not current_platform.is_cpu():  # before vLLM captures its graphs
            segment_graphs_at_hook_sites(active_sites())

    def execute_model(self, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        """vLLM's step, after following the served requests that carry their plans
        (:mod:`vlens.runtime.compiled.inline`)."""
        runtime = getattr(self, RUNTIME_ATTRIBUTE, None)
        if InlineRequests.carried(scheduler_output) or (runtime is not None and runtime.inline.tags):
            runtime_of(self).follow_inline(scheduler_output)
        return super().execute_model(scheduler_output, *args, **kwargs)  # type: ignore[misc]


def worker_class_name() -> str:
    """The ``worker_cls`` of a compiled engine on this machine's vLLM platform."""
    from vllm.platforms import current_platform

    kind = "CPUGraphWorker" if current_platform.is_cpu() else "GPUGraphWorker"
    return f"{__name__}.{kind}"


def __getattr__(name: str) -> type:
    """The worker classes, made when vLLM imports them by name: each platform's worker module
    imports only on its own platform."""
    if name in ("CPUGraphWorker", "GPUGraphWorker"):
        return _graph_worker(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def _graph_worker(name: str) -> type:
    """vLLM's worker with :class:`InstallsGraphSites` before it and vlens's worker extension
    after it, as a direct base: vLLM adds the extension to a worker class's bases unless it is
    one already, and refuses a class that inherits its methods otherwise (as this one would
    once an eager engine in this process has extended vLLM's own worker class)."""
    from vlens.runtime.worker import WorkerExtension

    if name == "CPUGraphWorker":
        from vllm.v1.worker.cpu_worker import CPUWorker as base
    else:
        from vllm.v1.worker.gpu_worker import Worker as base
    return type(name, (InstallsGraphSites, base, WorkerExtension), {"__module__": __name__})


@contextmanager
def graph_names_for_workers(names: Sequence[GraphName]) -> Iterator[dict[str, str]]:
    """While an engine is built: ``names`` in a file the workers read (named in the environment
    they inherit); yields the engine arguments that make vLLM use the graph worker (none for
    an eager engine, which has no names)."""
    if not names:
        yield {}
        return
    with TemporaryDirectory(prefix="vlens-graph-") as folder:
        path = Path(folder) / "graph_names.pickle"
        path.write_bytes(cloudpickle.dumps(tuple(names)))
        previous = os.environ.get(GRAPH_NAMES_FILE)
        os.environ[GRAPH_NAMES_FILE] = str(path)
        try:
            yield {"worker_cls": worker_class_name()}
        finally:
            if previous is None:
                del os.environ[GRAPH_NAMES_FILE]
            else:
                os.environ[GRAPH_NAMES_FILE] = previous
