"""A full CUDA graph captured with a hook site inside calls the site at every replay, between
segments that compute on the graph's own buffers (:mod:`vlens.runtime.compiled.breaks`); needs CUDA
(and vLLM's CUDA build, whose weak references the site keeps)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from vlens.runtime.compiled import hook_sites
from vlens.runtime.compiled.breaks import SegmentedGraph, current
from vlens.runtime.vocabulary.locations import Site

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")


@pytest.fixture(autouse=True)
def vllm_ops() -> None:
    """vLLM's compiled ops (the weak references among them), which a vLLM worker has loaded."""
    pytest.importorskip("vllm._custom_ops")


class Layer(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = Layer()
        self.second = Layer()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x) * 3)


def captured(graph: torch.cuda.CUDAGraph, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``model(x)`` captured into ``graph`` as vLLM captures a full graph (its warm-up first)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        model(x)
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph, pool=torch.cuda.graph_pool_handle()):
        out = model(x)
    return out


def test_a_site_inside_a_full_graph_runs_at_every_replay_and_its_edit_is_computed_on() -> None:
    model = Model()
    calls: list[torch.Tensor] = []

    def handler(args: tuple, kwargs: dict, output: Any) -> None:
        calls.append(output.clone())
        output.mul_(10)

    number = hook_sites.install_hook_site(model, Site("first", "output"), handler)
    x = torch.zeros(4, device="cuda")
    graph = SegmentedGraph()
    out = captured(graph, model, x)
    assert current() is None
    try:
        x.fill_(2.0)
        graph.replay()
        torch.cuda.synchronize()
        assert calls == [] and out.tolist() == [10.0] * 4  # idle: (2 + 1) * 3 + 1
        hook_sites.activate((number,), True)
        x.fill_(1.0)
        graph.replay()
        torch.cuda.synchronize()
        assert [c.tolist() for c in calls] == [[2.0] * 4]
        assert out.tolist() == [61.0] * 4  # (1 + 1) * 10 * 3 + 1
    finally:
        hook_sites.activate((number,), False)


def test_a_graph_without_sites_replays_as_torch_captured_it() -> None:
    model = Model()
    x = torch.ones(4, device="cuda")
    graph = SegmentedGraph()
    out = captured(graph, model, x)
    x.fill_(3.0)
    graph.replay()
    torch.cuda.synchronize()
    assert out.tolist() == [13.0] * 4
