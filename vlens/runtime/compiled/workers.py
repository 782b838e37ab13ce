"""vLLM workers that install the compiled engine's traced hooks right after loading the model.

A compiled engine's hooks must be on the model before vLLM's first forward, which compiles it
(:mod:`vlens.runtime.compiled.graph`); vLLM runs that forward while the engine is built, inside each
worker, before anything from the user's process reaches the workers. So a compiled engine is
built with ``worker_cls`` naming one of the classes below (vLLM imports it by name in every
worker process, whether it forks or spawns them): its ``load_model`` loads as vLLM's own worker
does, then installs the declared names, which the user's process left in a file named by
:data:`GRAPH_NAMES_FILE` in the environment the workers inherit.

vLLM keeps what it compiled on disk, keyed by its own settings and the sources it traced, and a
later engine with the same key loads it instead of compiling. Which names vlens traced is not
among vLLM's settings, so each compiled engine adds its graph's key (:func:`graph_key`: the
names, their hook sites' numbers and vlens's sources) to vLLM's ``additional_config``, which vLLM
hashes into its own key: a second load of the same checkpoint with the same names takes its
compiled pieces from the cache, and an engine with other names never loads another's graph.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import cloudpickle

from vlens.runtime.compiled.breaks import segment_graphs_at_hook_sites
from vlens.runtime.compiled.graph import GraphName, install_graph_sites
from vlens.runtime.compiled.hook_sites import active_sites, number_sites_from
from vlens.runtime.compiled.inline import InlineRequests
from vlens.runtime.worker import GRAPH_ATTRIBUTE, RUNTIME_ATTRIBUTE, runtime_of

#: The environment variable naming the file of the graph names (set while an engine is built).
GRAPH_NAMES_FILE = "VLENS_GRAPH_NAMES_FILE"
#: The entry of vLLM's ``additional_config`` that holds a compiled engine's :func:`graph_key`.
GRAPH_KEY = "vlens_graph"
#: Hook sites each engine of a process may number (its block starts at a multiple of this;
#: sites installed outside an engine number from 0).
SITES_PER_ENGINE = 1 << 20
_blocks = itertools.count(SITES_PER_ENGINE, SITES_PER_ENGINE)


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
        # written by the user's own process
        first_site, names = cloudpickle.loads(Path(path).read_bytes())
        number_sites_from(first_site)
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
def graph_names_for_workers(names: Sequence[GraphName]) -> Iterator[dict[str, Any]]:
    """While an engine is built: ``names`` and the first number of the engine's hook sites in a
    file the workers read (named in the environment they inherit); yields the engine arguments
    that make vLLM use the graph worker and key its compile cache on the graph (none for an
    eager engine, which has no names). Where the graph has no key, vLLM's cache is off from
    then on in this process."""
    if not names:
        yield {}
        return
    first_site = next(_blocks)
    key = graph_key(names, first_site)
    # vLLM's ahead-of-time artifact would skip tracing the model on a later load; what vlens has
    # checked is a load that traces again and takes Inductor's compiled pieces from the cache.
    # Kept for the process, as below.
    os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")
    if key is None:
        # For the rest of the process: vLLM reads it again at every forward (whether its
        # compiled model is an ahead-of-time one), and a model compiled with the cache off
        # must keep reading it off.
        os.environ["VLLM_DISABLE_COMPILE_CACHE"] = "1"
    with TemporaryDirectory(prefix="vlens-graph-") as folder:
        path = Path(folder) / "graph_names.pickle"
        path.write_bytes(cloudpickle.dumps((first_site, tuple(names))))
        previous = os.environ.get(GRAPH_NAMES_FILE)
        os.environ[GRAPH_NAMES_FILE] = str(path)
        try:
            yield {"worker_cls": worker_class_name(),
                   **({"additional_config": {GRAPH_KEY: key}} if key else {})}
        finally:
            if previous is None:
                del os.environ[GRAPH_NAMES_FILE]
            else:
                os.environ[GRAPH_NAMES_FILE] = previous


def graph_key(names: Sequence[GraphName], first_site: int) -> str | None:
    """What makes a compiled graph vlens's: the traced names (as their reprs, which name sites,
    readers and shapes), the first hook site's number and vlens's sources. None for a graph with
    SAEs, whose weights the graph holds and the key does not cover."""
    if any(name.sae is not None for name in names):
        return None
    text = "\n".join([_sources_digest(), str(first_site), *map(repr, names)])
    return hashlib.sha256(text.encode()).hexdigest()[:24]


@functools.cache
def _sources_digest() -> str:
    package = Path(__file__).resolve().parents[2]
    digest = hashlib.sha256()
    for source in sorted(package.rglob("*.py")):
        digest.update(source.read_bytes())
    return digest.hexdigest()


def with_graph_args(args: dict[str, Any], graph_args: dict[str, Any]) -> dict[str, Any]:
    """The engine arguments ``args`` with :func:`graph_names_for_workers`' (a user's own
    ``additional_config`` keeps its entries)."""
    extra = graph_args.get("additional_config")
    if extra is None:
        return {**args, **graph_args}
    own = args.get("additional_config") or {}
    if not isinstance(own, dict):
        raise ValueError(
            "additional_config: on a compiled engine pass it as a dict, which vlens extends with "
            f"its graph's key ({GRAPH_KEY!r}) for vLLM's compile cache"
        )
    return {**args, **graph_args, "additional_config": {**own, **extra}}
