"""Turning one call (names to keep, hook functions, steers) into per-request plans for the workers,
and the rules of a compiled engine: what its graph can read and which hooks it can run.

Hook functions on attention scores, patterns and per-head results (derived names whose mapping
declares :class:`~vlens.names.mapping.ExplicitAttention`) become per-layer
:class:`~vlens.runtime.messages.AttentionPlan` values: the worker computes those layers'
attention for that request (:mod:`vlens.runtime.attention`)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from transformers import PretrainedConfig

from vlens.engine.support import EAGER
from vlens.hooked.hook_registry import HookRegistry
from vlens.names.compiled import LOGITS, CompiledNames, check_steerable, per_position_shape
from vlens.names.mapping import (
    AttentionStage,
    DerivedSpec,
    ExplicitAttention,
    ExplicitStage,
    HookSpec,
    Site,
    Spec,
    per_sample,
)
from vlens.runtime.messages import AttentionPlan, HookFunction, NamePlan, RequestPlan
from vlens.runtime.steering import AnySteer, SAESteer, Steer, as_hook_function, steers_by_name

HooksByName = dict[str, tuple[HookFunction, ...]]


class Planner:
    """Plans for the requests of one model's calls; ``compiled`` is None on an eager engine."""

    def __init__(
        self,
        specs: dict[str, Spec],
        registry: HookRegistry,
        config: PretrainedConfig,
        compiled: CompiledNames | None,
    ) -> None:
        self.specs = specs
        self.registry = registry
        self.config = config
        self.compiled = compiled
        self._widths: dict[str, int] = {}  # see width: asked once per steer, for every prompt
        #: the hook points of SAEs spliced in (:mod:`vlens.hooked.saes`): read and hooked in
        #: Python, outside a compiled engine's graph
        self.spliced: set[str] = set()
        #: each explicitly computable layer's stage names (scores, pattern, result)
        self.explicit: dict[ExplicitAttention, dict[AttentionStage, str]] = {}
        for name, spec in specs.items():
            if isinstance(spec, DerivedSpec) and isinstance(spec.hookable, ExplicitStage):
                stages = self.explicit.setdefault(spec.hookable.attention, {})
                stages[spec.hookable.stage] = name

    def site_names(self, names: Sequence[str]) -> list[str]:
        """The names read from vLLM sites that ``names`` need (derived names' sources
        included), in forward order."""
        needed = {site for name in names for site in self.registry.site_sources(name)}
        return [name for name in self.specs if name in needed]

    def plans(
        self,
        kept: Sequence[str],
        hooks: Sequence[HooksByName],
        steers: Sequence[tuple[AnySteer, ...]],
        shared: HooksByName,
    ) -> list[RequestPlan]:
        """One call's plans, one per prompt (``hooks[i]``, ``steers[i]``): :meth:`plan` with the
        call's size and the hook functions ``shared`` by all its prompts (added hooks and
        ``fwd_hooks``, which the worker may run once on the call's batch)."""
        size = len(hooks)
        return [self.plan(i, kept, hooks[i], steers[i], size, shared) for i in range(size)]

    def plan(
        self,
        index: int,
        kept: Sequence[str],
        hooks: HooksByName,
        steers: tuple[AnySteer, ...] = (),
        call_size: int = 1,
        shared: HooksByName | None = None,
    ) -> RequestPlan:
        """Request ``index``'s names by site, in forward order: each with its hook functions and
        whether its value is kept for the cache. On a compiled engine the traced names go to
        the graph, and so do the steers; on an eager one steers become hook functions. Hooks on
        attention scores, patterns and results become :meth:`attention_plans`. A name's hooks
        are marked shared where they are exactly the call's ``shared`` functions (no prompt
        hook or steer of this request's own among them)."""
        if self.compiled is not None:
            graph_keep = frozenset(name for name in kept if name in self.compiled.traced)
            kept = [name for name in kept if name not in graph_keep]
            traced_steering = self.compiled.steering
        else:
            graph_keep = frozenset()
            traced_steering = frozenset()
        for steer in steers:  # those the graph does not apply run as hook functions
            if isinstance(steer, Steer) and steer.name not in traced_steering:
                function = as_hook_function(steer, self.width(steer.name))
                hooks = {**hooks, steer.name: (*hooks.get(steer.name, ()), function)}
        steers = tuple(
            steer for steer in steers
            if isinstance(steer, SAESteer) or steer.name in traced_steering
        )
        if not hooks and not kept:  # steering in the graph at most (a served request, often)
            return RequestPlan(index, {}, graph_keep, steers, (), call_size)
        common = shared_names(hooks, shared or {})
        sites: dict[Site, list[NamePlan]] = {}
        for name, spec in self.specs.items():
            if (name not in hooks and name not in kept) or isinstance(spec, DerivedSpec):
                continue
            functions = hooks.get(name, ())
            plan = NamePlan(name, spec.read, spec.arrange, functions, name in kept, name in common)
            sites.setdefault(spec.site, []).append(plan)
        by_site = {site: tuple(plans) for site, plans in sites.items()}
        attention = self.attention_plans(kept, hooks, common)
        return RequestPlan(index, by_site, graph_keep, steers, attention, call_size)

    def attention_plans(
        self, kept: Sequence[str], hooks: HooksByName, shared: frozenset[str] = frozenset()
    ) -> tuple[AttentionPlan, ...]:
        """One plan per layer whose scores, pattern or results carry hook functions, in forward
        order. A stage the worker forms is kept for the cache (as the hooks leave it) when the
        names it is rebuilt from are kept, i.e. when the call may want it: the cache then holds
        the worker's value instead of one rebuilt from q and k (scores and pattern are kept
        together: hooks on one change the other). A plan is shared when every hooked stage's
        name is in ``shared``."""
        hooked: dict[ExplicitAttention, dict[AttentionStage, tuple[HookFunction, ...]]] = {}
        hooked_names: dict[ExplicitAttention, list[str]] = {}
        for name, functions in hooks.items():
            spec = self.specs[name]
            if isinstance(spec, DerivedSpec):
                assert isinstance(spec.hookable, ExplicitStage), f"{name} cannot carry hooks"
                hooked.setdefault(spec.hookable.attention, {})[spec.hookable.stage] = functions
                hooked_names.setdefault(spec.hookable.attention, []).append(name)
        plans = []
        kept_names = set(kept)
        for attention, names in self.explicit.items():
            if attention not in hooked:
                continue
            stage_hooks = hooked[attention]
            formed = {"result"} if stage_hooks.get("result") else set()
            if stage_hooks.get("scores") or stage_hooks.get("pattern"):
                formed |= {"scores", "pattern"}
            keep = frozenset(
                stage
                for stage in formed
                if stage in names and set(self.registry.site_sources(names[stage])) <= kept_names
            )
            common = all(name in shared for name in hooked_names[attention])
            plans.append(AttentionPlan(attention, dict(names), stage_hooks, keep, common))
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
        name = self.registry.names(steer.name)[0]
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

    # ---- a compiled engine's rules -------------------------------------------------------------

    def served(self, name: str) -> bool:
        """Whether ``name`` is among what a call without ``names_filter`` (or with a filter)
        reads: any name in eager mode; on a compiled engine, a declared name traced into its
        graph, one read outside the forward (the sampler's names), or one derived from such
        names only. The logits, always traced, count only where declared."""
        if self.compiled is not None and name == LOGITS:  # traced, but only read when asked for
            return LOGITS in self.compiled.capture
        return all(self._without_forward_hooks(site) for site in self.registry.site_sources(name))

    def check_graph_reads(self, kept: Sequence[str], return_type: str | None) -> None:
        """Refuse names a compiled engine's graph does not capture."""
        missing = [name for name in kept if not self._without_forward_hooks(name)]
        if not missing:
            return
        if missing == [LOGITS] and return_type == "logits":
            raise ValueError(
                f"return_type='logits' reads {LOGITS}, which this compiled engine does not "
                f"capture: add it to compiled_capture when loading, or pass return_type=None"
            )
        assert self.compiled is not None
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        shown = ", ".join(missing[:5]) + more
        raise ValueError(
            f"{shown} not traced into this compiled engine's graph (it captures "
            f"{len(self.compiled.capture)} names, declared when it was loaded): load it with them "
            f"in compiled_capture, or use {EAGER} to read any name"
        )

    def check_hook_functions(self, names: Sequence[str]) -> None:
        """Hook functions run inside a compiled graph only at the names declared in
        ``compiled_hooks``: say what to do instead elsewhere."""
        if self.compiled is None:
            return
        hookable = self.compiled.hooks | self.spliced
        inside = [n for n in names if not per_sample(self.specs[n]) and n not in hookable]
        if inside:
            raise ValueError(
                f"a Python hook function on {inside[0]} cannot run on this compiled engine: its "
                f"forward is a traced graph, and hook functions run inside it only at the names "
                f"declared when it was loaded ({sorted(hookable)[:3] or 'none'}"
                f"{', ...' if len(hookable) > 3 else ''}). Load it with compiled_hooks=["
                f"{inside[0]!r}], steer as data (Steer({inside[0]!r}, add=vector) with the name in "
                f"compiled_steering), or load {EAGER}"
            )

    def _without_forward_hooks(self, name: str) -> bool:
        """Whether ``name`` needs no hook added to the forward: always on an eager engine; on a
        compiled one, a name traced into its graph, read at one of its hook sites, or read
        after the forward (the sampler's), or at an SAE spliced in."""
        if self.compiled is None:
            return True
        compiled = self.compiled
        return (
            name in compiled.traced
            or name in compiled.hooks
            or name in self.spliced
            or per_sample(self.specs[name])
        )


def shared_names(hooks: HooksByName, shared: HooksByName) -> frozenset[str]:
    """The names whose hook functions are exactly ``shared``'s (the same objects, in order)."""
    return frozenset(
        name
        for name, functions in hooks.items()
        if functions
        and len(functions) == len(shared.get(name, ()))
        and all(mine is theirs for mine, theirs in zip(functions, shared[name]))
    )
