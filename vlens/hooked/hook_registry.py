"""The hook functions a model carries between calls: TransformerLens's ``add_hook`` /
``reset_hooks`` bookkeeping, in the user's process. Names are resolved when a hook is added, so a
wrong name fails there, not in the middle of a batch, and so does a name that cannot carry a hook
on this engine.

Derived names (computed after the forward, :mod:`vlens.names.derived`) carry hooks only where the
mapping lets the worker form them for real (:class:`~vlens.names.mapping.ExplicitStage`: attention
scores, patterns and per-head results, computed explicitly at the hooked layers); the rest are
refused with what to hook instead."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from vlens.names.mapping import DerivedSpec, ExplicitStage, NoExplicitAttention, Spec, site_sources
from vlens.names.resolve import Explain, canonical
from vlens.runtime.messages import HookFunction

NameOrFilter = str | Callable[[str], bool]
FwdHooks = Sequence[tuple[NameOrFilter, HookFunction]]


@dataclass(frozen=True)
class AddedHook:
    name: str
    function: HookFunction
    permanent: bool


class HookRegistry:
    """Hook functions by canonical name, in the order they were added."""

    def __init__(
        self, specs: dict[str, Spec], explain: Explain | None = None, tensor_parallel_size: int = 1
    ) -> None:
        self.specs = specs
        self.explain = explain
        #: the engine's; hooks that need whole modules on one rank are refused above 1
        self.tensor_parallel_size = tensor_parallel_size
        self.added: list[AddedHook] = []

    def names(self, name_or_filter: NameOrFilter) -> list[str]:
        """The canonical names a hook name or filter stands for. A name that cannot carry a hook
        is refused; a filter, as TransformerLens's over its hook points, passes over such names."""
        if not callable(name_or_filter):
            name = canonical(name_or_filter, self.specs, explain=self.explain)
            refusal = self._refusal(name)
            if refusal is not None:
                raise refusal
            return [name]
        chosen = [name for name in self.specs if name_or_filter(name)]
        refusals = {name: self._refusal(name) for name in chosen}
        names = [name for name in chosen if refusals[name] is None]
        if not names:
            refused = [refusal for refusal in refusals.values() if refusal is not None]
            if refused:
                raise refused[0]
            raise ValueError("the hook's name filter accepted none of this model's hook names")
        return names

    def _refusal(self, name: str) -> Exception | None:
        """Why ``name`` cannot carry a hook here, or None where it can."""
        spec = self.specs[name]
        if not isinstance(spec, DerivedSpec):
            return None
        if isinstance(spec.hookable, ExplicitStage):
            if self.tensor_parallel_size > 1:
                return NotImplementedError(
                    f"{name} cannot carry a hook under tensor parallelism yet "
                    f"(tensor_parallel_size={self.tensor_parallel_size}): vlens computes that "
                    f"layer's attention in the worker from whole q, k, v and W_O, and each rank "
                    f"holds only its own heads. Use tensor_parallel_size=1, or hook "
                    f"{', '.join(self.site_sources(name))} instead"
                )
            return None
        feeds = ", ".join(self.site_sources(name))
        built = f"rebuilds it afterwards from {feeds}" if feeds else "reads it afterwards"
        change = f", or hook {feeds} to change what it is built from" if feeds else ""
        why = f" ({spec.hookable.reason})" if isinstance(spec.hookable, NoExplicitAttention) else ""
        return ValueError(
            f"{name} cannot carry a hook: vLLM never forms it during the forward; vlens "
            f"{built}{why}. Read it with run_with_cache{change}."
        )

    def site_sources(self, name: str) -> list[str]:
        """The names read from vLLM that a derived name is built from."""
        return site_sources(self.specs, name)

    def add(self, name_or_filter: NameOrFilter, function: HookFunction, permanent: bool) -> None:
        if not callable(function):
            raise TypeError(f"a hook function must be callable, got {type(function).__name__}")
        self.added += [AddedHook(n, function, permanent) for n in self.names(name_or_filter)]

    def reset(self, including_permanent: bool) -> None:
        self.added = [hook for hook in self.added if hook.permanent and not including_permanent]

    def resolve(
        self, fwd_hooks: FwdHooks, with_added: bool = True
    ) -> dict[str, tuple[HookFunction, ...]]:
        """``fwd_hooks`` (for one call), after the hooks added so far unless ``with_added`` is
        False, by canonical name."""
        by_name: dict[str, list[HookFunction]] = {}
        for hook in self.added if with_added else ():
            by_name.setdefault(hook.name, []).append(hook.function)
        for name_or_filter, function in fwd_hooks:
            for name in self.names(name_or_filter):
                by_name.setdefault(name, []).append(function)
        return {name: tuple(functions) for name, functions in by_name.items()}
