"""Captured CUDA graphs composed into one executable graph, through the CUDA driver's graph API.

torch captures a graph and launches it whole; it has no call that puts several captured graphs
into one launch. The driver does: each graph becomes a child graph node of a new graph, the
nodes in a chain, and the new graph is instantiated once and launched as one
(``cuGraphAddChildGraphNode``, ``cuGraphInstantiateWithFlags``, ``cuGraphLaunch``). The child
nodes are copies of the captured graphs' nodes, so their kernels read and write the same memory
(the captures' pool, which the captured graphs keep alive).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence

import torch


class DriverError(RuntimeError):
    """The CUDA driver refused a call of its graph API."""


@functools.cache
def _driver() -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as error:
        raise DriverError(f"the CUDA driver library cannot be loaded: {error}") from None
    handle = ctypes.c_void_p
    signatures = {
        "cuGraphCreate": [ctypes.POINTER(handle), ctypes.c_uint],
        "cuGraphAddChildGraphNode": [ctypes.POINTER(handle), handle, ctypes.POINTER(handle),
                                     ctypes.c_size_t, handle],
        "cuGraphGetNodes": [handle, ctypes.POINTER(handle), ctypes.POINTER(ctypes.c_size_t)],
        "cuGraphInstantiateWithFlags": [ctypes.POINTER(handle), handle, ctypes.c_ulonglong],
        "cuGraphLaunch": [handle, handle],
        "cuGraphDestroy": [handle],
        "cuGraphExecDestroy": [handle],
    }
    for name, arguments in signatures.items():
        function = getattr(lib, name)
        function.argtypes = arguments
        function.restype = ctypes.c_int
    return lib


def _check(result: int, call: str) -> None:
    if result != 0:
        raise DriverError(f"{call} returned CUDA error {result}")


def node_count(graph: int) -> int:
    count = ctypes.c_size_t(0)
    _check(_driver().cuGraphGetNodes(ctypes.c_void_p(graph), None, ctypes.byref(count)),
           "cuGraphGetNodes")
    return count.value


class Executable:
    """An instantiated graph, launched on the current stream by calling it."""

    def __init__(self, handle: int | None) -> None:
        self.handle = handle  # None: nothing to launch

    def __call__(self) -> None:
        if self.handle is None:
            return
        stream = torch.cuda.current_stream().cuda_stream
        _check(_driver().cuGraphLaunch(ctypes.c_void_p(self.handle), ctypes.c_void_p(stream)),
               "cuGraphLaunch")

    def destroy(self) -> None:
        if self.handle is not None:
            _driver().cuGraphExecDestroy(ctypes.c_void_p(self.handle))
            self.handle = None


def compose(graphs: Sequence[int]) -> Executable:
    """One executable graph running ``graphs`` (raw ``cudaGraph_t`` handles) in order; the empty
    ones are left out."""
    driver = _driver()
    children = [graph for graph in graphs if node_count(graph) > 0]
    if not children:
        return Executable(None)
    whole = ctypes.c_void_p()
    _check(driver.cuGraphCreate(ctypes.byref(whole), 0), "cuGraphCreate")
    try:
        previous: ctypes.c_void_p | None = None
        for child in children:
            node = ctypes.c_void_p()
            dependencies = ctypes.byref(previous) if previous is not None else None
            _check(driver.cuGraphAddChildGraphNode(ctypes.byref(node), whole, dependencies,
                                                   0 if previous is None else 1,
                                                   ctypes.c_void_p(child)),
                   "cuGraphAddChildGraphNode")
            previous = node
        executable = ctypes.c_void_p()
        _check(driver.cuGraphInstantiateWithFlags(ctypes.byref(executable), whole, 0),
               "cuGraphInstantiateWithFlags")
    finally:
        driver.cuGraphDestroy(whole)
    return Executable(executable.value)
