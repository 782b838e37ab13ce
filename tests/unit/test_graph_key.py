"""A compiled engine's key in vLLM's compile cache (:func:`vlens.runtime.compiled.workers.graph_key`):
the same for the same graph, another for other names or another block of hook sites, none where
the graph holds an SAE's weights; and the engine arguments that carry it."""

from __future__ import annotations

import dataclasses

import pytest

from vlens.runtime.compiled.graph import GraphName
from vlens.runtime.compiled.workers import GRAPH_KEY, graph_key, with_graph_args
from vlens.runtime.vocabulary.locations import Site
from vlens.runtime.vocabulary.readers import OutputOf


def names(*layers: int) -> tuple[GraphName, ...]:
    return tuple(GraphName(f"blocks.{i}.hook_resid_post", Site(f"model.layers.{i}", "output"),
                           OutputOf(), (), capture=False, steer=False, hook=True) for i in layers)


def test_the_key_follows_the_graph() -> None:
    key = graph_key(names(0, 1), 1 << 20)
    assert key is not None and key == graph_key(names(0, 1), 1 << 20)
    assert key != graph_key(names(0), 1 << 20)
    assert key != graph_key(names(0, 1), 2 << 20)


def test_a_graph_with_an_sae_has_no_key() -> None:
    with_sae = (dataclasses.replace(names(0)[0], sae=object()),)
    assert graph_key(with_sae, 1 << 20) is None


def test_the_key_joins_a_users_additional_config() -> None:
    graph_args = {"worker_cls": "w", "additional_config": {GRAPH_KEY: "k"}}
    args = with_graph_args({"dtype": "float32", "additional_config": {"mine": 1}}, graph_args)
    assert args == {"dtype": "float32", "worker_cls": "w",
                    "additional_config": {"mine": 1, GRAPH_KEY: "k"}}
    assert with_graph_args({"dtype": "float32"}, {}) == {"dtype": "float32"}
    with pytest.raises(ValueError, match="additional_config: on a compiled engine pass it as a dict"):
        with_graph_args({"additional_config": "{}"}, graph_args)
