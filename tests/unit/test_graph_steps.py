"""The compiled engine's work around each step (``GraphSites.before_step``), on a one-layer module:
steering terms are placed on the steered requests' rows, and a step that repeats the last one's
rows and requests writes nothing, yet every step's forward is steered as if placed anew."""

import numpy as np
import pytest
import torch
from torch import nn

from vlens import Steer
from vlens.runtime.compiled import graph as graph_module
from vlens.runtime.compiled.graph import GraphName, GraphSites
from vlens.runtime.steps.layout import RequestRows, StepRows, rows_of
from vlens.runtime.tensor_parallel import TensorParallel
from vlens.runtime.vocabulary.locations import Site
from vlens.runtime.vocabulary.readers import OutputOf
from vlens.runtime.vocabulary.steering import steered

WIDTH = 4
NAME = "blocks.0.hook_resid_post"


class OneLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


@pytest.fixture
def sites(monkeypatch) -> GraphSites:
    monkeypatch.setattr(TensorParallel, "of_this_worker", classmethod(lambda cls: cls(0, 1)))
    name = GraphName(NAME, Site("layer", "output"), OutputOf(None, None, None), (WIDTH,),
                     capture=False, steer=True)
    return GraphSites(OneLayer(), [name], 16, torch.device("cpu"), torch.float32)


def step(tags: list[str], lengths: list[int], first: list[int]) -> StepRows:
    starts = np.concatenate([[0], np.cumsum(lengths)])
    return rows_of([f"id-{t}" for t in tags], starts, first, lambda i: (i[3:], 8))


def expected(x: torch.Tensor, layout: list[RequestRows], steers: dict[str, Steer]) -> torch.Tensor:
    out = x.clone()
    for rows in layout:
        steer = steers.get(rows.tag)
        if steer is None:
            continue
        for offset in steer.offsets(rows.first_position, rows.stop - rows.start):
            row = rows.start + offset
            out[row] = steered(x[row], *steer.terms(WIDTH))
    return out


def forward(sites: GraphSites, layout: StepRows, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    sites.before_step(layout)
    x = torch.randn(rows, WIDTH, generator=torch.Generator().manual_seed(rows))
    return x, sites.model(x.clone())


def test_a_repeated_step_writes_nothing_and_still_steers(sites, monkeypatch):
    steers = {"a": Steer(NAME, add=torch.ones(WIDTH)), "c": Steer(NAME, add=-torch.ones(WIDTH))}
    for tag in "abc":
        sites.prepare(tag, frozenset(), [steers[tag]] if tag in steers else [])
    writes = []
    set_rows = graph_module.SteeringBuffers.set_rows
    monkeypatch.setattr(graph_module.SteeringBuffers, "set_rows",
                        lambda self, *args: (writes.append(1), set_rows(self, *args)))
    prefill = step(list("abc"), [3, 2, 3], [0, 0, 0])
    x, out = forward(sites, prefill, 8)
    torch.testing.assert_close(out, expected(x, prefill, steers))
    for position in range(3, 6):  # decode steps: one row each, the same rows every step
        decode = step(list("abc"), [1, 1, 1], [position] * 3)
        x, out = forward(sites, decode, 3)
        torch.testing.assert_close(out, expected(x, decode, steers))
    assert len(writes) == 2  # the prefill's rows, then the first decode step's


def test_a_request_joining_or_a_positional_steer_places_terms_again(sites):
    steers = {"a": Steer(NAME, add=torch.ones(WIDTH))}
    sites.prepare("a", frozenset(), [steers["a"]])
    decode = step(["a", "b"], [1, 1], [4, 4])
    forward(sites, decode, 2)
    # b joins with the same rows and ids as before (an id the runner reuses): its steer counts
    steers["b"] = Steer(NAME, add=2 * torch.ones(WIDTH), positions=[5])
    sites.prepare("b", frozenset(), [steers["b"]])
    for position in (5, 6):  # b's steer picks position 5 only: its rows move with positions
        decode = step(["a", "b"], [1, 1], [position] * 2)
        x, out = forward(sites, decode, 2)
        torch.testing.assert_close(out, expected(x, decode, steers))
    sites.finish(["a", "b"])
    x, out = forward(sites, decode, 2)
    torch.testing.assert_close(out, x)  # the call is over: every row neutral
