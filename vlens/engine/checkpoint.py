"""A model as vlens knows it without its engine: a checkpoint's config, mapping, names, weights
and planner. ``HookedVLLM`` is a checkpoint plus an engine; ``vlens serve``'s API process holds a
checkpoint alone (its engine runs in vLLM's engine process); planning a call, assembling its
values and budgeting its memory take a checkpoint.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from transformers import AutoConfig, PretrainedConfig

from vlens.engine.arguments import check_loadable, hooks_in_graph_by_default
from vlens.engine.planning import Planner
from vlens.mappings import mapping_for
from vlens.names.compiled import CompiledNames, declare, declare_saes, every_name
from vlens.names.derived import SampledTokens
from vlens.names.mapping import (
    ArchitectureMapping,
    DerivedSpec,
    HookSpec,
    Site,
    Spec,
    names_after,
)
from vlens.names.resolve import NamesFilter
from vlens.names.rules import NameRules
from vlens.names.weight_views import AnalysisWeights
from vlens.names.weights import CheckpointWeights
from vlens.runtime.vocabulary.readers import OutputOf
from vlens.sae.autoencoder import SAE

#: Engine-level names, the same for every architecture, one row per sampled token: each step's
#: logits for the token a request samples next, as the sampler receives them (editable: a hook
#: can ban or boost tokens for one request), and the token it sampled (read-only).
SAMPLER_NAMES: dict[str, Spec] = {
    "sampler.hook_logits": HookSpec(Site("logits_processor", "sampled"), OutputOf(), "new_pos d_vocab"),
    "sampler.hook_tokens": DerivedSpec((), SampledTokens(), "new_pos"),
}


class Checkpoint:
    """One checkpoint's names (:attr:`hook_specs`, in forward order, and the rules of its
    engine), weights, config and planner; ``compiled`` is None for an eager engine. (The
    tokenizer is the model's: ``HookedVLLM`` sets it up as TransformerLens does.)

    :attr:`hook_specs` and :attr:`canonical_names` are the model's one list of names, shared by
    every part: raw locations join the specs when first used, SAEs spliced in add their hook
    points to both (:meth:`set_names`)."""

    def __init__(
        self,
        path: str | Path,
        config: PretrainedConfig,
        mapping: ArchitectureMapping,
        compiled: CompiledNames | None = None,
        tensor_parallel_size: int = 1,
    ) -> None:
        self.path = Path(path)
        self.hf_config = config
        self.mapping = mapping
        self.compiled = compiled
        self.tensor_parallel_size = tensor_parallel_size
        self.explain = mapping.unavailable
        self.hook_specs: dict[str, Spec] = all_specs(mapping, config, compiled)
        self.canonical_names = list(self.hook_specs)
        self.rules = NameRules(
            self.hook_specs, self.canonical_names, compiled, self.explain, tensor_parallel_size
        )
        self.planner = Planner(self.rules, config)
        self.weights = CheckpointWeights(path)
        self.analysis = AnalysisWeights(self.weights, mapping.weights, config)

    @classmethod
    def load(
        cls,
        path: str | Path,
        engine_kwargs: dict[str, Any],
        compiled_capture: NamesFilter | Sequence[str] = (),
        compiled_steering: NamesFilter | Sequence[str] = (),
        compiled_hooks: NamesFilter | Sequence[str] = (),
        compiled_saes: dict[str, SAE | str | Path] | None = None,
        compiled_sae_slots: int = 1024,
        compiled_sae_top_k: int | None = None,
        hooks_by_default: bool = False,
    ) -> Checkpoint:
        """The checkpoint at ``path``, refused before any engine starts where vlens cannot serve
        it with these engine arguments, with its compiled names declared (none: eager; with
        ``hooks_by_default``, on a GPU, hook functions at every name of the compiled graph)."""
        config = AutoConfig.from_pretrained(path)
        mapping = mapping_for(config)
        wants_graph = bool(compiled_capture or compiled_steering or compiled_hooks or compiled_saes)
        if hooks_by_default and not wants_graph and hooks_in_graph_by_default(mapping, engine_kwargs):
            compiled_hooks, wants_graph = every_name, True
        check_loadable(mapping, config.architectures[0], engine_kwargs, wants_graph)
        if compiled_sae_top_k is not None and not compiled_saes:
            raise ValueError("compiled_sae_top_k without compiled_saes: declare the SAEs it reads")
        compiled = None
        if wants_graph:
            specs = all_specs(mapping, config)
            compiled = declare(specs, config, compiled_capture, compiled_steering,
                               mapping.unavailable, compiled_hooks)
            if compiled_saes:
                saes = declare_saes(compiled_saes, specs, config, compiled_sae_slots,
                                    compiled_sae_top_k, mapping.unavailable)
                compiled = compiled.with_saes(saes, specs, config)
        ranks = int(engine_kwargs.get("tensor_parallel_size", 1))
        return cls(path, config, mapping, compiled, ranks)

    @property
    def graph_names(self) -> tuple:
        """What the engine traces into its graph (nothing on an eager engine)."""
        return self.compiled.graph_names if self.compiled is not None else ()

    def set_names(self, specs: dict[str, Spec], canonical: set[str]) -> None:
        """Replace the model's names: ``specs`` (in forward order; raw locations admitted so far
        among them), of which ``canonical`` are its canonical names."""
        self.hook_specs.clear()
        self.hook_specs.update(specs)
        self.canonical_names[:] = [name for name in specs if name in canonical]

    def add_names_after(self, name: str, added: dict[str, Spec]) -> None:
        """Make ``added`` names of the model, canonical ones, right after ``name``."""
        self.set_names(names_after(self.hook_specs, name, added),
                       {*self.canonical_names, *added})


def all_specs(
    mapping: ArchitectureMapping, config: PretrainedConfig, compiled: CompiledNames | None = None
) -> dict[str, Spec]:
    """Every name of a model: its architecture's (each compiled SAE's top-k names after the
    name it reads), then the sampler's."""
    specs = mapping.expanded(config)
    for compiled_sae in (compiled.saes.values() if compiled is not None else ()):
        hook = specs[compiled_sae.hook]
        assert isinstance(hook, HookSpec)
        added = {
            name: dataclasses.replace(hook, shape=f"pos {compiled_sae.top_k}", arrange=None)
            for name in compiled_sae.captured_names
        }
        specs = names_after(specs, compiled_sae.hook, added)
    return {**specs, **SAMPLER_NAMES}
