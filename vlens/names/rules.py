"""What one engine can do at each name: read it in a call, carry a hook function, take a raw
location. Each refusal names the reason and what to do instead, raised where the user can act
(when a hook is added, before a call runs).

An eager engine reads and hooks every name vLLM computes. A compiled engine's forward is a traced
graph: it reads only the names traced into it (``compiled_capture``) or read at its hook sites
(``compiled_hooks``), and runs hook functions only at those sites; the names read after the
forward (the sampler's) and the hook points of SAEs spliced in run in Python on either.
Derived names (computed after the forward, :mod:`vlens.names.derived`) carry hooks only where the
mapping lets the worker form them for real (attention scores, patterns and per-head results,
:class:`~vlens.names.mapping.ExplicitStage`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from vlens.names.compiled import EAGER, LOGITS, CompiledNames
from vlens.names.mapping import (
    DerivedSpec,
    ExplicitStage,
    NoExplicitAttention,
    Spec,
    per_sample,
    site_sources,
)
from vlens.names.resolve import Explain, is_pattern, select

#: A hook's name: one name, a glob pattern, or a filter over the model's names.
NameOrFilter = str | Callable[[str], bool]


@dataclass
class NameRules:
    """The rules of one model's engine; ``compiled`` is None on an eager engine.

    ``specs`` are every name of the model (raw locations admitted included), in forward order,
    and ``canonical_names`` its canonical names among them: the model's own lists, which grow as
    names are added. Hooks that need whole modules on one rank are refused where
    ``tensor_parallel_size`` is above 1."""

    specs: dict[str, Spec]
    canonical_names: list[str]
    compiled: CompiledNames | None
    explain: Explain | None = None
    tensor_parallel_size: int = 1
    #: the hook points of SAEs spliced in (``HookedVLLM.add_sae``): read and hooked in Python,
    #: outside a compiled engine's graph
    spliced: set[str] = field(default_factory=set)

    # ---- hook functions ----------------------------------------------------------------------

    def hook_names(self, name_or_filter: NameOrFilter) -> list[str]:
        """The canonical names a hook's name, pattern or filter stands for, each able to carry a
        hook function on some engine of this model (:meth:`check_hook_functions` says whether on
        this one). A name that cannot is refused; a pattern or a filter, as TransformerLens's
        filters over its hook points, passes over such names."""
        if callable(name_or_filter):  # TransformerLens adds nothing where its filter accepts none
            chosen = [name for name in self.specs if name_or_filter(name)]
            if not chosen:
                warnings.warn(f"the hook's name filter {_label(name_or_filter)} accepts none of "
                              f"this model's hook names; no hook added", stacklevel=4)
                return []
        else:
            chosen = select(name_or_filter, list(self.specs), self.explain,
                            label="the hook's name filter")
        refusals = {name: self._hook_refusal(name) for name in chosen}
        named = isinstance(name_or_filter, str) and not is_pattern(name_or_filter)
        names = [name for name in chosen if refusals[name] is None]
        if named or not names:
            refused = next((refusal for refusal in refusals.values() if refusal is not None), None)
            if refused is not None:
                raise refused
        return names

    def _hook_refusal(self, name: str) -> Exception | None:
        """Why ``name`` cannot carry a hook on any engine of this model, or None where it can."""
        spec = self.specs[name]
        if not isinstance(spec, DerivedSpec):
            return None
        feeds = ", ".join(site_sources(self.specs, name))
        if isinstance(spec.hookable, ExplicitStage):
            if self.tensor_parallel_size > 1:
                return NotImplementedError(
                    f"{name} cannot carry a hook under tensor parallelism yet "
                    f"(tensor_parallel_size={self.tensor_parallel_size}): vlens computes that "
                    f"layer's attention in the worker from whole q, k, v and W_O, and each rank "
                    f"holds only its own heads. Use tensor_parallel_size=1, or hook {feeds} instead"
                )
            return None
        built = f"rebuilds it afterwards from {feeds}" if feeds else "reads it afterwards"
        change = f", or hook {feeds} to change what it is built from" if feeds else ""
        why = f" ({spec.hookable.reason})" if isinstance(spec.hookable, NoExplicitAttention) else ""
        return ValueError(
            f"{name} cannot carry a hook: vLLM never forms it during the forward; vlens "
            f"{built}{why}. Read it with run_with_cache{change}."
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

    # ---- reading -----------------------------------------------------------------------------

    def served(self, name: str) -> bool:
        """Whether ``name`` is among what a call without ``names_filter`` (or with a filter)
        reads: any name in eager mode; on a compiled engine, a declared name traced into its
        graph, one read outside the forward (the sampler's), or one derived from such
        names only. The logits, always traced, count only where declared."""
        if self.compiled is not None and name == LOGITS:  # traced, but only read when asked for
            return LOGITS in self.compiled.capture
        return all(self._without_forward_hooks(site) for site in site_sources(self.specs, name))

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

    # ---- raw locations -----------------------------------------------------------------------

    def check_raw_location(self, name: str) -> None:
        """Raw module locations need hooks added after loading, on one rank's whole values."""
        if self.compiled is not None:
            raise ValueError(
                f"{name}: raw module locations need {EAGER} (a compiled engine's forward is a "
                f"traced graph; it runs no hooks added after loading)"
            )
        if self.tensor_parallel_size > 1:
            raise NotImplementedError(
                f"{name}: raw locations are not yet available under tensor parallelism (each "
                f"rank holds its own slice of many modules' values); use canonical names"
            )


def _label(function: Callable[[str], bool]) -> str:
    return getattr(function, "__qualname__", None) or repr(function)
