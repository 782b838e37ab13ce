"""Declaring, when a model loads, which names its compiled graph reads, steers and runs hook
functions at.

vLLM's compiled mode traces the forward once; only hooks present at that moment run afterwards
(:mod:`vlens.runtime.compiled.graph`). So a compiled engine serves exactly the names declared here:
``compiled_capture`` (names to read; a derived name such as ``attn.hook_pattern`` declares the
names it is built from), ``compiled_steering`` (names :class:`~vlens.runtime.vocabulary.steering.Steer`
values may change) and ``compiled_hooks`` (names where Python hook functions run inside the graph,
:mod:`vlens.runtime.compiled.hook_sites`; such a name can also be read and steered, through the same
site; an attention stage, scores, pattern or per-head results, declares the names it is built
from and a ``call`` site where the layer's attention is computed in Python for its hooks).
Everything else is refused with the eager alternative named.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PretrainedConfig

from vlens.names.mapping import (
    DerivedSpec,
    ExplicitStage,
    HookSpec,
    NoExplicitAttention,
    Spec,
    attention_dimensions,
    site_sources,
)
from vlens.names.resolve import Explain, NamesFilter, canonical, select
from vlens.runtime.compiled.graph import GraphName
from vlens.runtime.compiled.saes import CompiledSAE
from vlens.runtime.hooks.split_inputs import split_of
from vlens.runtime.vocabulary.locations import Site
from vlens.runtime.vocabulary.readers import LogitsOf, writable
from vlens.sae.autoencoder import SAE

#: How to get an engine that runs any Python hook function on any name.
EAGER = "HookedVLLM.from_pretrained(path, enforce_eager=True) (eager mode)"


def every_name(name: str) -> bool:
    """``compiled_hooks`` of the default engine on a GPU: hook functions at every name."""
    return True

#: The logits: traced into every compiled graph as the final norm's rows (one ``d_model`` row
#: per position; the vocabulary-wide logits are computed after the step, for rows kept only), so
#: that a compiled engine returns logits as an eager one does.
LOGITS = "unembed.hook_out"


@dataclass(frozen=True)
class CompiledNames:
    """What a compiled engine's graph reads (``capture``, as declared, and ``traced``: those
    and the logits), may change (``steering``) and runs hook functions at (``hooks``)."""

    capture: frozenset[str]
    steering: frozenset[str]
    graph_names: tuple[GraphName, ...]
    traced: frozenset[str] = frozenset()
    hooks: frozenset[str] = frozenset()
    #: the SAEs whose features the graph edits and captures, by the name steers call them
    saes: dict[str, CompiledSAE] = dataclasses.field(default_factory=dict)

    def with_saes(self, saes: Sequence[CompiledSAE], specs: dict[str, Spec],
                  config: PretrainedConfig) -> CompiledNames:
        """These names and ``saes``' (each a steering target and its top-k names)."""
        graph_names = list(self.graph_names)
        captured = set()
        for compiled in saes:
            spec = specs[compiled.hook]
            assert isinstance(spec, HookSpec)
            graph_names.append(GraphName(
                compiled.target, spec.site, spec.read, (compiled.slots,), capture=False,
                steer=True, sae=compiled,
            ))
            for name, dtype in zip(compiled.captured_names, (None, torch.int32)):
                graph_names.append(GraphName(
                    name, spec.site, spec.read, (compiled.top_k,), capture=True, steer=False,
                    sae=compiled, dtype=dtype,
                ))
                captured.add(name)
        return dataclasses.replace(
            self,
            capture=self.capture | captured,
            traced=self.traced | captured,
            graph_names=tuple(graph_names),
            saes={compiled.name: compiled for compiled in saes},
        )


def declare(
    specs: dict[str, Spec],
    config: PretrainedConfig,
    capture: NamesFilter | Sequence[str],
    steering: NamesFilter | Sequence[str],
    explain: Explain | None = None,
    hooks: NamesFilter | Sequence[str] = (),
) -> CompiledNames:
    """The graph names for ``capture``, ``steering`` and ``hooks`` (name lists or name
    filters)."""
    known = list(specs)
    captured: set[str] = set()
    for name in _chosen(capture, known, explain):
        captured |= set(site_sources(specs, name))
    steered = set(_chosen(steering, known, explain))
    hooked = set(_chosen(hooks, known, explain))
    named = {hooks} if isinstance(hooks, str) else set(hooks) if not callable(hooks) else set()
    for name in sorted(hooked):
        if name in named:  # named one by one: what cannot carry hooks in the graph is refused
            check_hookable(name, specs[name])
    hooked = {name for name in hooked if hookable_in_graph(specs[name])}
    for name in sorted(hooked):  # a split input's hooks run at the block input and projections
        found = split_of(name)
        if found is not None:
            hooked |= {found[0], *(target for _, target in found[1])}
    attention = explicit_attention(specs, hooked)
    for name in sorted(hooked):  # a formed stage's sources, read where the eager engine reads them
        if isinstance(specs[name], DerivedSpec):
            hooked |= set(site_sources(specs, name))
    for name in sorted(captured | steered):
        spec = specs[name]
        if isinstance(spec, HookSpec) and spec.site.event == "sampled":
            raise ValueError(
                f"{name} is read after the forward, outside the compiled graph: it needs no "
                f"declaration (read it and hook it as on an eager engine)"
            )
    for name in sorted(steered):
        check_steerable(name, specs[name])
    traced = captured | logits_rows(specs)
    graph_names = tuple(
        GraphName(
            name,
            spec.site,
            spec.read,
            per_position_shape(spec, config) if name in traced | steered else (),
            capture=name in traced,
            steer=name in steered,
            hook=name in hooked,
        )
        for name, spec in specs.items()
        if name in traced | steered | hooked and isinstance(spec, HookSpec)
    ) + tuple(
        GraphName(name, site, None, (), capture=False, steer=False, hook=True)
        for site, name in attention.items()
    )
    return CompiledNames(
        frozenset(captured), frozenset(steered), graph_names, frozenset(traced), frozenset(hooked)
    )


def hookable_in_graph(spec: Spec) -> bool:
    """Whether hook functions can run at a name inside the graph: one read from a module call
    of the forward, or a stage of attention that vlens can compute in Python (scores, pattern,
    per-head results)."""
    if isinstance(spec, DerivedSpec):
        return isinstance(spec.hookable, ExplicitStage)
    return spec.site.event != "sampled"


def explicit_attention(specs: dict[str, Spec], hooked: set[str]) -> dict[Site, str]:
    """The ``call`` sites where the graph computes attention in Python for the hooked stages
    (the attention kernel for scores and patterns, the output projection for per-head
    results), each with the first stage name that needs it."""
    sites: dict[Site, str] = {}
    for name in sorted(hooked):
        spec = specs[name]
        if isinstance(spec, DerivedSpec) and isinstance(spec.hookable, ExplicitStage):
            path = spec.hookable.attention.module_of(spec.hookable.stage)
            sites.setdefault(Site(path, "call"), name)
    return sites


def check_hookable(name: str, spec: Spec) -> None:
    """Hook functions run inside the graph at a name read from one module call of the forward."""
    if isinstance(spec, HookSpec) and spec.site.event == "sampled":
        raise ValueError(
            f"{name} is read after the forward, outside the compiled graph: it needs no "
            f"declaration (hook it as on an eager engine)"
        )
    if isinstance(spec, DerivedSpec) and isinstance(spec.hookable, NoExplicitAttention):
        raise NotImplementedError(f"{name} cannot carry hook functions: {spec.hookable.reason}")
    if isinstance(spec, DerivedSpec) and not isinstance(spec.hookable, ExplicitStage):
        raise ValueError(
            f"{name} is computed from other names after the forward and cannot carry hook "
            f"functions; declare and hook the names it is built from "
            f"({', '.join(spec.sources)})"
        )


def logits_rows(specs: dict[str, Spec]) -> set[str]:
    """:data:`LOGITS`, where the graph can keep it as final-norm rows."""
    spec = specs.get(LOGITS)
    return {LOGITS} if isinstance(spec, HookSpec) and isinstance(spec.read, LogitsOf) else set()


def check_steerable(name: str, spec: Spec) -> None:
    """A :class:`~vlens.runtime.vocabulary.steering.Steer` changes one of vLLM's own position-major tensors through
    its name's write rule: refuse any other name."""
    if isinstance(spec, DerivedSpec) or not writable(spec.read) or spec.arrange is not None:
        raise ValueError(
            f"{name} cannot be steered with Steer: it is not one of vLLM's own position-major "
            f"tensors; steer a name that feeds it"
        )


def per_position_shape(spec: HookSpec, config: PretrainedConfig) -> tuple[int, ...]:
    """The shape of one position's value of what the graph computes for ``spec`` (for the
    logits, the final norm's row they are computed from), from its jaxtyping shape."""
    labels = spec.shape.split()
    if spec.arrange is not None:  # the shape is TransformerLens's order; the reader's is rows first
        source, target = (side.split()[1:] for side in spec.arrange.split("->"))
        by_axis = dict(zip(target, labels))
        labels = [by_axis[axis] for axis in source]
    if isinstance(spec.read, LogitsOf):
        labels = ["pos", "d_model"]
    return tuple(dimension(label, config, spec.shape) for label in labels[1:])


def dimension(label: str, config: PretrainedConfig, shape: str) -> int:
    """The size of one axis label of a mapping file's shapes, from the HuggingFace config."""
    heads, kv_heads, d_head = attention_dimensions(config)
    experts = next(
        (
            getattr(config, name)
            for name in ("n_routed_experts", "num_experts", "num_local_experts")
            if isinstance(getattr(config, name, None), int)
        ),
        None,
    )
    sizes = {
        "1": 1,
        "d_model": config.hidden_size,
        "d_mlp": getattr(config, "intermediate_size", None) or 4 * config.hidden_size,
        "head": heads,
        "kv_head": kv_heads,
        "d_head": d_head,
        "heads_d_head": heads * d_head,
        "kv_heads_d_head": kv_heads * d_head,
        "d_vocab": config.vocab_size,
        "top_k": getattr(config, "num_experts_per_tok", None),
        "n_routed_experts": experts,
    }
    size = sizes[label] if label in sizes else getattr(config, label, None)
    if label.isdigit():  # a width the name's owner knows (an SAE's d_sae)
        size = int(label)
    if not isinstance(size, int):
        raise NotImplementedError(
            f"a value of shape {shape!r} cannot be traced into the compiled graph yet (no size "
            f"for {label!r} in the config); read it with {EAGER}"
        )
    return size


def _chosen(
    names: NamesFilter | Sequence[str], known: list[str], explain: Explain | None
) -> list[str]:
    if names is None:
        raise ValueError(
            "compiled names must be listed (or given as a filter): tracing every name into the "
            "graph would copy every activation at every step"
        )
    if not callable(names) and not isinstance(names, str) and len(names) == 0:
        return []
    return select(names, known, explain)


def declare_saes(
    saes: dict[str, SAE | str | Path],
    specs: dict[str, Spec],
    config: PretrainedConfig,
    slots: int,
    top_k: int | None,
    explain: Explain | None = None,
) -> list[CompiledSAE]:
    """``compiled_saes`` (name -> an SAE, or the folder SAELens saved it in), checked against
    the model: one SAE per name it reads."""
    if slots < 1:
        raise ValueError(f"compiled_sae_slots={slots}: at least one feature must fit")
    declared: dict[str, CompiledSAE] = {}
    for name, sae in saes.items():
        if not isinstance(name, str) or not name or ":" in name:
            raise ValueError(f"compiled_saes: {name!r} is not a usable SAE name (a string "
                             f"without ':')")
        if isinstance(sae, (str, Path)):
            sae = SAE.load_from_disk(sae)
        try:
            sae = SAE.of(sae)
        except TypeError:
            raise TypeError(
                f"compiled_saes[{name!r}] is a {type(sae).__name__}: give an SAE (vlens's or "
                f"SAELens's) or the folder SAELens saved it in"
            ) from None
        if top_k is not None and not 1 <= top_k <= sae.cfg.d_sae:
            raise ValueError(f"compiled_sae_top_k={top_k}: between 1 and the SAE's d_sae "
                             f"({sae.cfg.d_sae})")
        hook = sae_hook_name(sae, specs, config, explain)
        other = next((d for d in declared.values() if d.hook == hook), None)
        if other is not None:
            raise ValueError(f"compiled_saes: {other.name!r} and {name!r} both read {hook}; "
                             f"declare one SAE per name")
        declared[name] = CompiledSAE(name, hook, sae, slots, top_k)
    return list(declared.values())


def sae_hook_name(
    sae: SAE, specs: dict[str, Spec], config: PretrainedConfig, explain: Explain | None
) -> str:
    """The canonical name ``sae`` reads, checked to be one whose value it can replace on this
    model (a position-major tensor of the model, of the SAE's ``d_in``)."""
    hook_name = sae.cfg.hook_name
    if not hook_name:
        raise ValueError(
            "the SAE names no hook_name (its cfg.json has none, at the top or in metadata): "
            "SAELens records the name it was trained on there"
        )
    name = canonical(hook_name, specs, explain=explain)
    spec = specs[name]
    if not isinstance(spec, HookSpec) or not writable(spec.read):
        raise ValueError(
            f"{name} is computed from the model's tensors, not one of them: an SAE's output "
            f"cannot replace it. Use an SAE trained on a name the model computes on "
            f"(hook_resid_pre/mid/post, hook_mlp_out, hook_attn_out, attn.hook_z, ...)"
        )
    width = per_position_shape(spec, config)
    d_in = 1
    for size in width:
        d_in *= size
    hook_z = sae.cfg.reshape_activations == "hook_z"
    if d_in != sae.cfg.d_in or hook_z != (len(width) == 2):
        raise ValueError(
            f"the SAE reads {name} with d_in={sae.cfg.d_in}"
            f"{' (hook_z: heads × d_head)' if hook_z else ''}, but this model's {name} has "
            f"{list(width)} per position: an SAE trained on another model, or on another name"
        )
    return name
