"""A site is a torch hook on one vLLM module; it hands each followed request its own rows.

The torch hook sees the whole step (every request's rows, concatenated). For each request that
asked for a name at this site it builds a :class:`NarrowedCall` (views onto that request's rows)
and lets the name's reader compute TransformerLens's value from it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from vlens.mapping import Site
from vlens.runtime.layout import RequestRows


def narrow(value: Any, rows: RequestRows) -> Any:
    """The rows of one request in a token-major tensor; anything else passes through."""
    if isinstance(value, Tensor) and value.dim() > 0:
        return value[rows.start : rows.stop]
    return value


@dataclass
class NarrowedCall:
    """One module call, seen through one request's rows (see :class:`vlens.mapping.SiteCall`)."""

    model: nn.Module
    rows: RequestRows
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    result: Any = None

    def argument(self, index: int, name: str) -> Any:
        if name in self.kwargs:
            return narrow(self.kwargs[name], self.rows)
        return narrow(self.args[index], self.rows) if index < len(self.args) else None

    def raw_argument(self, index: int, keyword: str | None) -> Any:
        """An argument by keyword, else by position (keywords follow positionals in call order)."""
        if keyword is not None and keyword in self.kwargs:
            return narrow(self.kwargs[keyword], self.rows)
        if 0 <= index < len(self.args):
            return narrow(self.args[index], self.rows)
        return narrow(list(self.kwargs.values())[index - len(self.args)], self.rows)

    def output(self, element: int | None) -> Any:
        value = self.result if element is None else self.result[element]
        return narrow(value, self.rows)

    def storages(self) -> set[int]:
        """Addresses of the storages behind this call's tensors, to tell views from new values."""
        values = [*self.args, *self.kwargs.values()]
        values += list(self.result) if isinstance(self.result, tuple) else [self.result]
        return {v.untyped_storage().data_ptr() for v in values if isinstance(v, Tensor)}


def detached_copy(value: Tensor, call: NarrowedCall) -> Tensor:
    """``value`` as a tensor of its own: vLLM reuses and rewrites its buffers in place."""
    if value.untyped_storage().data_ptr() in call.storages():
        return value.clone()
    return value


def find_module(model: nn.Module, path: str) -> nn.Module:
    try:
        return model.get_submodule(path)
    except AttributeError:
        raise LookupError(
            f"vLLM's module tree for {type(model).__name__} has no module {path!r}: the mapping "
            f"file does not match this model (print(model) shows the tree)"
        ) from None


def install_site(model: nn.Module, site: Site, on_call: Callable[[tuple, dict, Any], None]):
    """Register the torch hook for ``site``; returns its removable handle."""
    module = find_module(model, site.path)
    if site.event == "input":

        def pre_hook(_module: nn.Module, args: tuple, kwargs: dict) -> None:
            on_call(args, kwargs, None)

        return module.register_forward_pre_hook(pre_hook, with_kwargs=True)

    def post_hook(_module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        on_call(args, kwargs, output)

    return module.register_forward_hook(post_hook, with_kwargs=True)


@torch.no_grad()
def read_rows(call: NarrowedCall, reader: Callable[[NarrowedCall], Tensor]) -> Tensor:
    return detached_copy(reader(call), call)
