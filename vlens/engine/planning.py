"""Turning one call (names to read, hook functions, steers, what it returns) into per-request
plans for the workers: :meth:`Planner.call`, the one way every kind of call goes.

Hook functions on attention scores, patterns and per-head results (derived names whose mapping
declares :class:`~vlens.names.mapping.ExplicitAttention`) become per-layer
:class:`~vlens.runtime.transfer.messages.AttentionPlan` values: the worker computes those layers'
attention for that request (:mod:`vlens.runtime.attention.explicit`)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from transformers import PretrainedConfig

from vlens.names.compiled import EAGER, LOGITS, check_steerable, per_position_shape
from vlens.names.mapping import (
    AttentionStage,
    DerivedSpec,
    ExplicitAttention,
    ExplicitStage,
    HookSpec,
    Site,
    site_sources,
)
from vlens.names.resolve import NamesFilter, select
from vlens.names.rules import NameRules
from vlens.runtime.transfer.messages import (
    AttentionPlan,
    HookFunction,
    NamePlan,
    PaddingSide,
    RequestPlan,
)
from vlens.runtime.vocabulary.steering import (
    AnySteer,
    SAESteer,
    Steer,
    as_hook_function,
    steers_by_name,
)

HooksByName = dict[str, tuple[HookFunction, ...]]


@dataclass(frozen=True)
class CallPlan:
    """One call as the engine runs it (:meth:`Planner.call`)."""

    names: list[str]  # the names its cache holds
    result: str | None  # the name its output is read from (None: no output)
    wanted: list[str]  # the names computed once it finishes: ``names`` and ``result``
    kept: list[str]  # the names read at vLLM's sites for them
    plans: list[RequestPlan]  # one per prompt
    padding_side: PaddingSide = "right"  # of the hook functions' batches and of the cache


class Planner:
    """Plans for the requests of one model's calls; ``compiled`` is None on an eager engine."""

    def __init__(self, rules: NameRules, config: PretrainedConfig) -> None:
        self.rules = rules
        self.specs = rules.specs
        self.config = config
        self.compiled = rules.compiled
        self._widths: dict[str, int] = {}  # see width: asked once per steer, for every prompt
        #: each explicitly computable layer's stage names (scores, pattern, result)
        self.explicit: dict[ExplicitAttention, dict[AttentionStage, str]] = {}
        for name, spec in self.specs.items():
            if isinstance(spec, DerivedSpec) and isinstance(spec.hookable, ExplicitStage):
                stages = self.explicit.setdefault(spec.hookable.attention, {})
                stages[spec.hookable.stage] = name

    def call(
        self,
        prompts: int,
        names_filter: NamesFilter = (),
        hooks: Sequence[HooksByName] | None = None,
        shared: HooksByName | None = None,
        steering: Sequence[AnySteer] = (),
        prompt_steering: Sequence[Sequence[AnySteer]] | None = None,
        return_type: str | None = None,
        stop_at_layer: int | None = None,
        padding_side: PaddingSide = "right",
    ) -> CallPlan:
        """What a call of ``prompts`` prompts means, worked out the same way for
        ``run_with_cache``, ``forward``, ``generate`` and a served request: the names
        ``names_filter`` picks (:meth:`names`), the name its output is read from
        (``return_type``'s logits, or with ``stop_at_layer`` the residual entering that block,
        keeping only names computed before it), what is read at vLLM's sites for them (refused
        where a compiled graph does not capture it), each prompt's steers and hook functions
        (``hooks[i]``; those ``shared`` by every prompt run on the call's batch, padded on
        ``padding_side``) and a plan per prompt."""
        names = self.names(names_filter)
        result = LOGITS if return_type is not None else None
        if stop_at_layer is not None:
            stop = stopping_layer(stop_at_layer, self.config.num_hidden_layers)
            names = [name for name in names if computed_before(name, stop)]
            result = residual_entering(stop, self.config.num_hidden_layers)
        wanted = names + ([result] if result is not None and result not in names else [])
        kept = self.site_names(wanted)
        self.rules.check_graph_reads(kept, return_type)
        steers = self.steering(steering, prompt_steering, prompts)
        plans = self.plans(kept, hooks or [{}] * prompts, steers, shared or {}, padding_side)
        return CallPlan(names, result, wanted, kept, plans, padding_side)

    def names(self, names_filter: NamesFilter) -> list[str]:
        """The names a call's ``names_filter`` picks, in forward order: names listed, among
        every name (raw locations admitted included); without a list (None, a function), among
        the canonical names this engine serves (:meth:`NameRules.served`)."""
        if names_filter == [] or names_filter == ():
            return []
        known = list(self.specs)
        if names_filter is None or callable(names_filter):
            known = [name for name in self.rules.canonical_names if self.rules.served(name)]
        return select(names_filter, known, self.rules.explain)

    def site_names(self, names: Sequence[str]) -> list[str]:
        """The names read from vLLM sites that ``names`` need (derived names' sources
        included), in forward order."""
        needed = {site for name in names for site in site_sources(self.specs, name)}
        return [name for name in self.specs if name in needed]

    def plans(
        self,
        kept: Sequence[str],
        hooks: Sequence[HooksByName],
        steers: Sequence[tuple[AnySteer, ...]],
        shared: HooksByName,
        padding_side: PaddingSide = "right",
    ) -> list[RequestPlan]:
        """One call's plans, one per prompt: each with its own hook functions (``hooks[i]``, less
        those ``shared`` by every prompt, which run once on the call's padded batch) and steers
        (``steers[i]``), at the same names at every site for the whole call. On a compiled
        engine the traced names go to the graph, and so do the steers it applies; elsewhere
        steers become hook functions of their prompt."""
        graph_keep = frozenset()
        if self.compiled is not None:
            graph_keep = frozenset(name for name in kept if name in self.compiled.traced)
            kept = [name for name in kept if name not in graph_keep]
        own = [self._own_hooks(hooks[i], steers[i], shared) for i in range(len(hooks))]
        graph_steers = [self._graph_steers(steers_i) for steers_i in steers]
        if not kept and not shared and not any(own):  # steering in the graph at most
            return [
                RequestPlan(i, {}, graph_keep, graph_steers[i], (), len(hooks),
                            padding_side=padding_side)
                for i in range(len(hooks))
            ]
        named = {*kept, *shared, *(name for mine in own for name in mine)}
        return [
            RequestPlan(
                index,
                self._sites(named, set(kept), mine, shared),
                graph_keep,
                graph_steers[index],
                self.attention_plans(kept, mine, shared),
                len(hooks),
                padding_side=padding_side,
            )
            for index, mine in enumerate(own)
        ]

    def _own_hooks(
        self, hooks: HooksByName, steers: tuple[AnySteer, ...], shared: HooksByName
    ) -> HooksByName:
        """A prompt's own hook functions: its ``hooks`` past the ``shared`` ones they begin
        with, then the steers the graph does not apply, as hook functions."""
        own = {}
        for name, functions in hooks.items():
            common = shared.get(name, ())
            if functions[: len(common)] != common:
                raise AssertionError(f"{name}: a prompt's hooks must begin with the shared ones")
            if functions[len(common):]:
                own[name] = functions[len(common):]
        traced = self.compiled.steering if self.compiled is not None else frozenset()
        for steer in steers:
            if isinstance(steer, Steer) and steer.name not in traced:
                function = as_hook_function(steer, self.width(steer.name))
                own[steer.name] = (*own.get(steer.name, ()), function)
        return own

    def _graph_steers(self, steers: tuple[AnySteer, ...]) -> tuple[AnySteer, ...]:
        """The steers a compiled graph applies itself: SAE edits, and steers at its
        ``compiled_steering`` names."""
        traced = self.compiled.steering if self.compiled is not None else frozenset()
        return tuple(s for s in steers if isinstance(s, SAESteer) or s.name in traced)

    def _sites(
        self, named: set[str], kept: set[str], own: HooksByName, shared: HooksByName
    ) -> dict[Site, tuple[NamePlan, ...]]:
        """One request's names by site, in forward order: every name some prompt of the call
        hooks or keeps (derived names' hooks go to :meth:`attention_plans`)."""
        sites: dict[Site, list[NamePlan]] = {}
        for name, spec in self.specs.items():
            if name not in named or isinstance(spec, DerivedSpec):
                continue
            plan = NamePlan(name, spec.read, spec.arrange, own.get(name, ()), name in kept,
                            shared.get(name, ()))
            sites.setdefault(spec.site, []).append(plan)
        return {site: tuple(plans) for site, plans in sites.items()}

    def attention_plans(
        self, kept: Sequence[str], own: HooksByName, shared: HooksByName
    ) -> tuple[AttentionPlan, ...]:
        """One plan per layer whose scores, pattern or results carry hook functions (a prompt's
        ``own`` or the call's ``shared``), in forward order. A stage the worker forms is kept
        for the cache (as the hooks leave it) when the names it is rebuilt from are kept, i.e.
        when the call may want it: the cache then holds the worker's value instead of one
        rebuilt from q and k (scores and pattern are kept together: hooks on one change the
        other)."""
        hooked: dict[ExplicitAttention, set[AttentionStage]] = {}
        for name in {*own, *shared}:
            spec = self.specs[name]
            if isinstance(spec, DerivedSpec):
                assert isinstance(spec.hookable, ExplicitStage), f"{name} cannot carry hooks"
                hooked.setdefault(spec.hookable.attention, set()).add(spec.hookable.stage)
        plans = []
        kept_names = set(kept)
        for attention, names in self.explicit.items():
            if attention not in hooked:
                continue
            stages = hooked[attention]
            formed = {"result"} & stages
            if stages & {"scores", "pattern"}:
                formed |= {"scores", "pattern"}
            keep = frozenset(
                stage
                for stage in formed
                if stage in names and set(site_sources(self.specs, names[stage])) <= kept_names
            )
            plans.append(AttentionPlan(
                attention,
                dict(names),
                {stage: own[names[stage]] for stage in names if names[stage] in own},
                keep,
                {stage: shared[names[stage]] for stage in names if names[stage] in shared},
            ))
        return tuple(plans)

    def steering(
        self,
        steering: Sequence[AnySteer],
        prompt_steering: Sequence[Sequence[AnySteer]] | None,
        n_prompts: int,
    ) -> list[tuple[AnySteer, ...]]:
        """Each prompt's steers, by canonical name, checked against this engine."""
        if prompt_steering is not None and len(prompt_steering) != n_prompts:
            raise ValueError(
                f"prompt_steering has {len(prompt_steering)} entries for {n_prompts} prompts"
            )
        per_prompt = []
        for index in range(n_prompts):
            own = list(steering) + list(prompt_steering[index] if prompt_steering else ())
            resolved = [self._resolved_steer(steer) for steer in own]
            per_prompt.append(tuple(steers_by_name(resolved, f"prompt {index}").values()))
        self._check_sae_slots(per_prompt)
        return per_prompt

    def _check_sae_slots(self, per_prompt: list[tuple[AnySteer, ...]]) -> None:
        """A call's prompts edit at most a compiled SAE's slots of distinct features (its
        requests are all followed at once)."""
        features: dict[str, set[int]] = {}
        for steers in per_prompt:
            for steer in steers:
                if isinstance(steer, SAESteer):
                    features.setdefault(steer.sae, set()).update(map(int, steer.features))
        for name, chosen in features.items():
            assert self.compiled is not None
            slots = self.compiled.saes[name].slots
            if len(chosen) > slots:
                raise ValueError(
                    f"this call's prompts edit {len(chosen)} distinct features of SAE {name!r}; "
                    f"the engine was loaded with room for {slots} at once: load it with "
                    f"compiled_sae_slots={len(chosen)} or more, or split the call"
                )

    def width(self, name: str) -> int:
        """The number of elements of one position's value of ``name``."""
        if name not in self._widths:
            spec = self.specs[name]
            assert isinstance(spec, HookSpec)
            self._widths[name] = math.prod(per_position_shape(spec, self.config))
        return self._widths[name]

    def _resolved_steer(self, steer: AnySteer) -> AnySteer:
        if isinstance(steer, SAESteer):
            return self._checked_sae_steer(steer)
        if not isinstance(steer, Steer):
            raise TypeError(f"steering takes Steer and SAESteer values, got {type(steer).__name__}")
        name = self.rules.hook_names(steer.name)[0]
        compiled = self.compiled
        if compiled is not None and name not in compiled.steering | compiled.hooks:
            raise ValueError(
                f"{name} is not in this compiled engine's compiled_steering (declared when it "
                f"was loaded: {sorted(compiled.steering) or 'none'}); load it with "
                f"compiled_steering=[{name!r}], or use {EAGER}"
            )
        check_steerable(name, self.specs[name])
        resolved = dataclasses.replace(steer, name=name)
        resolved.check(self.width(name))  # before any request runs
        return resolved

    def _checked_sae_steer(self, steer: SAESteer) -> SAESteer:
        saes = self.compiled.saes if self.compiled is not None else {}
        if steer.sae not in saes:
            raise ValueError(
                f"SAESteer({steer.sae!r}): this engine has no SAE of that name in its graph "
                f"(compiled_saes: {sorted(saes) or 'none'}). Declare it when loading "
                f"(HookedVLLM.from_pretrained(path, compiled_saes={{{steer.sae!r}: sae}})), or "
                f"on an eager engine splice the SAE in with add_sae(sae, use_error_term=True) "
                f"and edit its features with a hook on hook_sae_acts_post"
            )
        d_sae = saes[steer.sae].sae.cfg.d_sae
        wrong = [int(f) for f in steer.features if not 0 <= int(f) < d_sae]
        if wrong:
            raise ValueError(
                f"SAESteer({steer.sae!r}): features {wrong} are not among the SAE's {d_sae}"
            )
        return steer


def stopping_layer(stop_at_layer: int, n_layers: int) -> int:
    """TransformerLens's ``stop_at_layer`` (negative counts from the end) as a block index:
    the forward runs blocks ``0 .. k-1`` and returns the residual stream entering block ``k``."""
    layer = n_layers + stop_at_layer if stop_at_layer < 0 else stop_at_layer
    if not 0 <= layer <= n_layers:
        raise ValueError(f"stop_at_layer={stop_at_layer} is outside [-{n_layers}, {n_layers}]")
    return layer


def residual_entering(layer: int, n_layers: int) -> str:
    """The name of the residual stream entering block ``layer`` (after the last: the final one)."""
    if layer < n_layers:
        return f"blocks.{layer}.hook_resid_pre"
    return f"blocks.{n_layers - 1}.hook_resid_post"


def computed_before(name: str, layer: int) -> bool:
    """Whether a forward stopped before block ``layer`` computes ``name``: the embeddings and
    the names of earlier blocks."""
    if name.startswith("blocks."):
        return int(name.split(".")[1]) < layer
    return name.startswith(("hook_embed", "hook_pos_embed"))
