"""The runner's choice of CUDA graph while a hook site is active: never a full graph, which would
replay what the site's op did once, at capture (vLLM's own dispatchers stood in for by fakes
with their signatures, so that both model runners are covered on a machine without a GPU)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest
from vllm.config import CUDAGraphMode

from vlens.runtime import hook_sites


class V1Dispatcher:
    """V1's ``CudagraphDispatcher.dispatch``: a full graph for a uniform decode step unless
    excluded, else piecewise."""

    def dispatch(self, num_tokens: int, uniform_decode: bool = False, has_lora: bool = False,
                 num_active_loras: int = 0, valid_modes: Any = None,
                 invalid_modes: Any = None) -> tuple[CUDAGraphMode, int]:
        if uniform_decode and CUDAGraphMode.FULL not in (invalid_modes or ()):
            return CUDAGraphMode.FULL, num_tokens
        return CUDAGraphMode.PIECEWISE, num_tokens


@dataclasses.dataclass
class Descriptor:
    cg_mode: CUDAGraphMode
    num_tokens: int
    num_reqs: int | None
    uniform_token_count: int | None


class V2Manager:
    """V2's ``CudaGraphManager.dispatch``: the first captured graph that fits; ``full_always``
    stands for a graph captured for any batch (``cudagraph_mode=FULL``)."""

    def __init__(self, full_always: bool) -> None:
        self.full_always = full_always

    def dispatch(self, num_reqs: int, num_tokens: int, uniform_token_count: int | None,
                 num_active_loras: int, max_query_len: int | None = None,
                 num_ubatches: int = 1) -> Descriptor:
        if self.full_always or uniform_token_count is not None:
            return Descriptor(CUDAGraphMode.FULL, 256, num_reqs, uniform_token_count)
        return Descriptor(CUDAGraphMode.PIECEWISE, 256, None, None)


@pytest.fixture
def site() -> Any:
    hook_sites.activate((999_001,), False)
    yield 999_001
    hook_sites.activate((999_001,), False)


def test_v1_full_graphs_only_while_no_site_is_active(site: int) -> None:
    runner = SimpleNamespace(cudagraph_dispatcher=V1Dispatcher())
    hook_sites.no_full_graphs_while_active(runner)
    hook_sites.no_full_graphs_while_active(runner)  # idempotent
    dispatch = runner.cudagraph_dispatcher.dispatch
    assert dispatch(256, uniform_decode=True)[0] == CUDAGraphMode.FULL
    hook_sites.activate((site,), True)
    assert dispatch(256, uniform_decode=True)[0] == CUDAGraphMode.PIECEWISE
    assert dispatch(256, True, invalid_modes={CUDAGraphMode.PIECEWISE})[0] != CUDAGraphMode.FULL
    hook_sites.activate((site,), False)
    assert dispatch(256, uniform_decode=True)[0] == CUDAGraphMode.FULL


@pytest.mark.parametrize("full_always", [False, True])
def test_v2_full_graphs_only_while_no_site_is_active(site: int, full_always: bool) -> None:
    runner = SimpleNamespace(cudagraph_manager=V2Manager(full_always))
    hook_sites.no_full_graphs_while_active(runner)
    hook_sites.no_full_graphs_while_active(runner)
    dispatch = runner.cudagraph_manager.dispatch
    assert dispatch(200, 200, 1, 0).cg_mode == CUDAGraphMode.FULL
    hook_sites.activate((site,), True)
    chosen = dispatch(200, 200, 1, 0)
    if full_always:  # no piecewise graph captured: the compiled graph without CUDA graphs
        assert chosen == Descriptor(CUDAGraphMode.NONE, 200, 200, None)
    else:
        assert chosen.cg_mode == CUDAGraphMode.PIECEWISE
    hook_sites.activate((site,), False)
    assert dispatch(200, 200, 1, 0).cg_mode == CUDAGraphMode.FULL
