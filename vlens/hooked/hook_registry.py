"""The hook functions a model carries between calls: TransformerLens's ``add_hook`` /
``reset_hooks`` bookkeeping, in the user's process. Names are resolved when a hook is added, so a
wrong name fails there, not in the middle of a batch, and so does a name that cannot carry a hook
on this engine (:class:`~vlens.names.rules.NameRules`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from vlens.hooked.split_inputs import placed
from vlens.names.rules import NameOrFilter, NameRules
from vlens.names.weight_views import AnalysisWeights
from vlens.runtime.transfer.messages import HookFunction

FwdHooks = Sequence[tuple[NameOrFilter, HookFunction]]


@dataclass(frozen=True)
class AddedHook:
    name: str
    function: HookFunction
    permanent: bool


class HookRegistry:
    """Hook functions by canonical name, in the order they were added."""

    def __init__(self, rules: NameRules, analysis: AnalysisWeights | None = None) -> None:
        self.rules = rules
        self.analysis = analysis  # the weights that place split inputs' hooks; None: not placed
        self.added: list[AddedHook] = []

    def names(self, name_or_filter: NameOrFilter) -> list[str]:
        """The canonical names a hook's name, pattern or filter stands for on this engine."""
        names = self.rules.hook_names(name_or_filter)
        self.rules.check_hook_functions(names)
        return names

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
        False, by canonical name; those on split attention inputs placed where their edits land
        (:mod:`vlens.hooked.split_inputs`)."""
        by_name: dict[str, list[HookFunction]] = {}
        for hook in self.added if with_added else ():
            by_name.setdefault(hook.name, []).append(hook.function)
        for name_or_filter, function in fwd_hooks:
            for name in self.names(name_or_filter):
                by_name.setdefault(name, []).append(function)
        resolved = {name: tuple(functions) for name, functions in by_name.items()}
        return resolved if self.analysis is None else placed(resolved, self.analysis)
