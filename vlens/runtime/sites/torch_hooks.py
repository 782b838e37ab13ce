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

from vlens.runtime.sites.source import SOURCE, install_operation_site
from vlens.runtime.steps.layout import RequestRows
from vlens.runtime.tensor_parallel import TensorParallel
from vlens.runtime.vocabulary.locations import Site, Split


def narrow(value: Any, rows: RequestRows | None, index: Tensor | None = None) -> Any:
    """The rows of one request in a token-major tensor (every row when ``rows`` is None), or,
    given ``index``, those rows of the step in that order (a copy); anything else passes
    through."""
    if not isinstance(value, Tensor) or value.dim() == 0:
        return value
    if index is not None:
        return value.index_select(0, index)
    return value if rows is None else value[rows.start : rows.stop]


@dataclass
class NarrowedCall:
    """One module call, seen through one request's rows (see :class:`vlens.runtime.vocabulary.locations.SiteCall`),
    or whole (``rows`` None: the compiled engine's traced hooks).

    Accessors return views into vLLM's tensors; a value split over tensor-parallel ranks
    (``shards``) comes whole instead, and ``assign_*`` writes this rank's slice back. With
    ``index`` (the rows of several requests, in the order of a hook function's batch, where
    they are not one span of the step) accessors return copies of those rows, and ``assign_*``
    writes them back in place.
    """

    model: nn.Module
    rows: RequestRows | None
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    result: Any = None
    parallel: TensorParallel | None = None  # None on one rank
    buffers: frozenset[int] = frozenset()  # see :func:`buffers_of`
    index: Tensor | None = None  # rows of several requests, gathered (see above)

    def _step_argument(self, index: int, name: str) -> Any:
        if name in self.kwargs:
            return self.kwargs[name]
        return self.args[index] if index < len(self.args) else None

    def _narrow(self, value: Any) -> Any:
        return narrow(value, self.rows, self.index)

    def _whole(self, local: Any, shards: Split | None) -> Any:
        if shards is None or self.parallel is None or local is None:
            return local
        return self.parallel.whole(local, shards)

    def _assign(self, step_value: Tensor, new: Tensor, shards: Split | None) -> None:
        local = self._narrow(step_value)
        if shards is not None and self.parallel is not None:
            new = self.parallel.own_part(new, shards, local)
        if self.index is not None:
            step_value.index_copy_(0, self.index, new.to(step_value.dtype))
        else:
            local.copy_(new)

    def argument(self, index: int, name: str, shards: Split | None = None) -> Any:
        return self._whole(self._narrow(self._step_argument(index, name)), shards)

    def assign_argument(self, index: int, name: str, new: Tensor, shards: Split | None = None) -> None:
        self._assign(self._step_argument(index, name), new, shards)

    def raw_argument(self, index: int, keyword: str | None) -> Any:
        """An argument by keyword, else by position (keywords follow positionals in call order)."""
        if keyword is not None and keyword in self.kwargs:
            return self._narrow(self.kwargs[keyword])
        if index < 0:
            raise ValueError(
                f"this call passes no keyword argument {keyword!r}; its keywords: "
                f"{', '.join(self.kwargs) or '(none)'}, and {len(self.args)} positional"
            )
        if 0 <= index < len(self.args):
            return self._narrow(self.args[index])
        return self._narrow(list(self.kwargs.values())[index - len(self.args)])

    def _step_output(self, element: int | None) -> Any:
        return self.result if element is None else self.result[element]

    def output(self, element: int | None, shards: Split | None = None) -> Any:
        return self._whole(self._narrow(self._step_output(element)), shards)

    def assign_output(self, element: int | None, new: Tensor, shards: Split | None = None) -> None:
        self._assign(self._step_output(element), new, shards)



def buffers_of(args: tuple, kwargs: dict, result: Any) -> frozenset[int]:
    """Addresses of the storages behind a module call's tensors, to tell views from new values
    (the same for every request of the call: computed once per call)."""
    values = [*args, *kwargs.values()]
    values += list(result) if isinstance(result, tuple) else [result]
    return frozenset(v.untyped_storage().data_ptr() for v in values if isinstance(v, Tensor))


def detached_copy(value: Tensor | None, call: NarrowedCall) -> Tensor | None:
    """``value`` as a tensor of its own: vLLM reuses and rewrites its buffers in place. (None:
    a value that lives on another tensor-parallel rank, such as gathered logits.)"""
    if value is not None and value.untyped_storage().data_ptr() in call.buffers:
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


class SiteHook:
    """A torch hook that hands a module call's ``(args, kwargs, output)`` to ``on_call``. An
    object rather than a closure: torch.compile, tracing a hook into a graph, guards on what a
    closure holds, and some of its versions cannot guard a function held that way."""

    def __init__(self, on_call: Callable[[tuple, dict, Any], None]) -> None:
        self.on_call = on_call

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict, output: Any = None) -> None:
        self.on_call(args, kwargs, output)


def install_site(model: nn.Module, site: Site, on_call: Callable[[tuple, dict, Any], None]):
    """Register the torch hook for ``site`` (or, for an operation inside a module's forward,
    ``PATH.source.OP``, route that call: :mod:`vlens.runtime.sites.source`); returns its removable
    handle."""
    if SOURCE in site.path:
        path, operation = site.path.split(SOURCE)
        return install_operation_site(
            find_module(model, path), path, operation, site.event != "input", on_call
        )
    module = find_module(model, site.path)
    if site.event == "input":
        return module.register_forward_pre_hook(SiteHook(on_call), with_kwargs=True)
    return module.register_forward_hook(SiteHook(on_call), with_kwargs=True)


@torch.no_grad()
def read_rows(call: NarrowedCall, reader: Callable[[NarrowedCall], Tensor]) -> Tensor | None:
    return detached_copy(reader(call), call)
