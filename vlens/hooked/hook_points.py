"""TransformerLens's ``HookPoint`` surface for one hook name of a vlens model:
``model.blocks[3].attn.hook_z.add_hook(fn)`` goes through the model's own hook registry."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, Protocol

from vlens.hooked.hook_registry import AddedHook, HookRegistry
from vlens.runtime.transfer.messages import HookFunction

if TYPE_CHECKING:
    from vlens.hooked.gradients import BackwardHook
    from vlens.names.weight_views import AnalysisWeights

Direction = Literal["fwd", "bwd", "both"]


class HookedModel(Protocol):
    """What the views use of the model they are mixed into."""

    cfg: Any  # n_layers, n_heads, d_model, d_head, d_mlp, positional_embedding_type
    analysis: AnalysisWeights
    registry: HookRegistry
    _backward: tuple[BackwardHook, ...]

    @property
    def hook_names(self) -> list[str]: ...

    def add_hook(
        self, name: str, hook: HookFunction, dir: Direction = "fwd", is_permanent: bool = False
    ) -> None: ...

    def remove_backward_hooks(self, name: str | None, including_permanent: bool) -> None: ...


class HookPointView:
    """One hook name of the model, with TransformerLens's ``HookPoint`` methods for its hooks."""

    def __init__(self, model: HookedModel, name: str) -> None:
        self.model = model
        self.name = name

    def add_hook(
        self, hook: HookFunction, dir: Direction = "fwd", is_permanent: bool = False
    ) -> None:
        """``model.add_hook(self.name, hook, ...)``."""
        self.model.add_hook(self.name, hook, dir=dir, is_permanent=is_permanent)

    def add_perma_hook(self, hook: HookFunction, dir: Direction = "fwd") -> None:
        self.add_hook(hook, dir=dir, is_permanent=True)

    @property
    def fwd_hooks(self) -> list[AddedHook]:
        """The hooks added at this name, in order."""
        return [hook for hook in self.model.registry.added if hook.name == self.name]

    def has_hooks(
        self,
        dir: Literal["fwd", "bwd", "both"] = "both",
        including_permanent: bool = True,
        level: None = None,
    ) -> bool:
        _check_direction(dir, level)
        hooks = [*(self.fwd_hooks if dir != "bwd" else []),
                 *(hook for hook in self.model._backward if dir != "fwd" and hook.name == self.name)]
        return any(including_permanent or not hook.permanent for hook in hooks)

    def remove_hooks(
        self,
        dir: Literal["fwd", "bwd", "both"] = "fwd",
        including_permanent: bool = False,
        level: None = None,
    ) -> None:
        """Remove the hooks added at this name (the permanent ones too with
        ``including_permanent``)."""
        _check_direction(dir, level)
        if dir != "fwd":
            self.model.remove_backward_hooks(self.name, including_permanent)
        if dir == "bwd":
            return
        registry = self.model.registry
        registry.added = [
            hook
            for hook in registry.added
            if hook.name != self.name or (hook.permanent and not including_permanent)
        ]

    def layer(self) -> int:
        """The block index of a ``blocks.{layer}.…`` name."""
        parts = self.name.split(".")
        if len(parts) < 3 or parts[0] != "blocks" or not parts[1].isdigit():
            raise ValueError(f"{self.name} is not a hook name inside a block (blocks.<layer>.…)")
        return int(parts[1])

    def __repr__(self) -> str:
        count = len(self.fwd_hooks)
        return f"HookPointView(name={self.name!r}" + (f", {count} fwd)" if count else ")")


def _check_direction(dir: str, level: int | None) -> None:
    if dir not in ("fwd", "bwd", "both"):
        raise ValueError(f"Invalid direction {dir}")
    if level is not None:
        raise ValueError("vlens's hooks have no context levels: give level=None")
