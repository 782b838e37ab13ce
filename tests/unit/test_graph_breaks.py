"""A full CUDA graph captured with hook sites inside calls each site at every replay in which it is
active, between runs of segments composed into one graph that compute on the graph's own buffers
(:mod:`vlens.runtime.compiled.breaks`); needs CUDA (and vLLM's CUDA build, whose weak references
the site keeps)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from vlens.runtime.compiled import breaks, driver_graphs, hook_sites
from vlens.runtime.compiled.breaks import SegmentedGraph, current
from vlens.runtime.vocabulary.locations import Site

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")


@pytest.fixture(autouse=True)
def vllm_ops() -> None:
    """vLLM's compiled ops (the weak references among them), which a vLLM worker has loaded."""
    pytest.importorskip("vllm._custom_ops")


@pytest.fixture(autouse=True)
def live_sites(monkeypatch: pytest.MonkeyPatch) -> None:
    """The graphs read the hook sites' live set, as a graph worker's do."""
    monkeypatch.setattr(breaks, "_active", hook_sites.active_sites())
    monkeypatch.setattr(breaks, "COMPOSE", True)


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


class Deeper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second, self.third = Layer(), Layer(), Layer()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.third(self.second(self.first(x) * 3) * 2)


@pytest.mark.parametrize("which", [(), (0,), (1,), (0, 1)])
def test_only_the_active_sites_break_the_replay(which: tuple[int, ...]) -> None:
    model = Deeper()
    seen: list[str] = []

    def handler(name: str):
        def run(args: tuple, kwargs: dict, output: Any) -> None:
            seen.append(name)
            output.add_(100)
        return run

    numbers = [hook_sites.install_hook_site(model, Site(path, "output"), handler(path))
               for path in ("first", "second")]
    x = torch.zeros(4, device="cuda")
    graph = SegmentedGraph()
    out = captured(graph, model, x)
    try:
        hook_sites.activate([numbers[i] for i in which], True)
        for value in (1.0, 2.0):  # the second replay reuses the composed plan
            seen.clear()
            x.fill_(value)
            graph.replay()
            torch.cuda.synchronize()
            first = value + 1 + (100 if 0 in which else 0)
            second = first * 3 + 1 + (100 if 1 in which else 0)
            assert out.tolist() == [second * 2 + 1] * 4
            assert seen == [("first", "second")[i] for i in which]
        plan = graph._plans[which]
        assert len(plan.launches) == len(which) + 1
        assert all(isinstance(launch, driver_graphs.Executable) for launch in plan.launches)
    finally:
        hook_sites.activate(numbers, False)
