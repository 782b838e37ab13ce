"""Raw vLLM locations as hook names: any module path of ``print(model)`` plus ``.output``,
``.input`` or ``.inputs`` — the escape hatch where no canonical name exists yet.

- ``PATH.output``: what the module returns. vLLM's linear layers return ``(tensor, bias)``; the
  hook sees the tensor (element 0). ``PATH.output.N`` picks element ``N`` of a tuple.
- ``PATH.input``: the first argument (positional, else the first keyword). ``PATH.input.N`` /
  ``PATH.input.NAME`` pick one argument by position or keyword.
- ``PATH.inputs``: a call's arguments are several tensors, and a cache holds one tensor per
  name: the error names each argument's own spelling.

Values are narrowed per request like every name (rows first: ``[1, pos, ...]`` in a hook),
copied when cached, and writable: an edit is copied into vLLM's own tensor.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property

from torch import Tensor

from vlens.engine.support import check_raw_location
from vlens.names.mapping import HookSpec, Spec
from vlens.names.resolve import UnknownHookName
from vlens.runtime.locations import Site, SiteCall
from vlens.runtime.messages import ModuleRecord

RAW_NAME = re.compile(r"(?P<path>[\w.]+?)\.(?P<kind>output|inputs|input)(?:\.(?P<part>\w+))?")


@dataclass(frozen=True)
class RawOutput:
    """Element ``element`` of a tuple result (0 when the result is a tuple and none is given)."""

    element: int | None

    def __call__(self, call: SiteCall) -> Tensor:
        result = call.output(None)
        if isinstance(result, tuple):
            return call.output(self.element or 0)
        if self.element is not None:
            raise ValueError(f"the module returns one tensor, not a tuple (no element {self.element})")
        return result

    def write(self, call: SiteCall, new: Tensor) -> None:
        self(call).copy_(new)


@dataclass(frozen=True)
class RawInput:
    """An argument by position (``index``), or by keyword (``keyword``: passed as that keyword,
    else at that parameter's position); by default the first argument, however passed."""

    index: int = 0
    keyword: str | None = None

    def __call__(self, call: SiteCall) -> Tensor:
        return call.raw_argument(self.index, self.keyword)

    def write(self, call: SiteCall, new: Tensor) -> None:
        self(call).copy_(new)


def raw_spec(name: str, modules: dict[str, ModuleRecord]) -> HookSpec:
    """The spec of a raw location, or an error saying why it cannot be one."""
    found = RAW_NAME.fullmatch(name)
    if found is None:
        raise UnknownHookName(name, modules, "this model's module tree")
    path, kind, part = found["path"], found["kind"], found["part"]
    record = modules.get(path)
    if record is None:
        raise UnknownHookName(
            path, modules, "vLLM's tree for this model", "print(model) shows it", "a module"
        )
    refuse_unusable(path, record)
    if kind == "inputs":
        spellings = [f"{path}.input.{i}" for i in range(record.positional)]
        spellings += [f"{path}.input.{keyword}" for keyword in record.keywords]
        raise ValueError(
            f"{name}: a call's arguments are several tensors and a cache holds one per name; "
            f"name one: {', '.join(spellings)}"
        )
    if kind == "output":
        return HookSpec(Site(path, "output"), RawOutput(int(part) if part else None), "pos ...")
    if part is None:
        return HookSpec(Site(path, "input"), RawInput(), "pos ...")
    if part.isdigit():
        return HookSpec(Site(path, "input"), RawInput(int(part)), "pos ...")
    if part not in record.parameters and part not in record.keywords:
        raise ValueError(
            f"{name}: {record.class_name}.forward has no argument {part!r}; its arguments: "
            f"{', '.join(record.parameters or record.keywords) or '(positional only: use .input.N)'}"
        )
    index = record.parameters.index(part) if part in record.parameters else -1
    return HookSpec(Site(path, "input"), RawInput(index, part), "pos ...")


def refuse_unusable(path: str, record: ModuleRecord) -> None:
    """Errors for modules whose hooks would not mean one layer's rows of one call."""
    if len(record.paths) > 1:
        others = [p for p in record.paths if p != path]
        raise ValueError(
            f"{path} is one {record.class_name} shared by {len(record.paths)} places ({', '.join(others[:3])}"
            f"{', ...' if len(others) > 3 else ''}): its hook would fire once for each of them. "
            f"Hook a per-layer module instead: one whose path is only this layer's, such as the "
            f"module that consumes its result (e.g. {path.rsplit('.', 1)[0]}.attn.input for a "
            f"rotary embedding), or a canonical name (model.hook_names)."
        )
    if not record.phases:
        raise ValueError(
            f"{path} ({record.class_name}) never runs as a module in vLLM (its forward hooks never "
            f"fire: vLLM calls its weights or a replaced __call__ directly); hook the module that "
            f"uses it, or a canonical name"
        )
    if not record.token_major:
        raise ValueError(
            f"{path} ({record.class_name}) returns a value that is not one row per token, so it "
            f"cannot be narrowed to one request; hook a module whose result is per token"
        )


def prefill_only(path: str, modules: dict[str, ModuleRecord]) -> bool:
    """Whether the module runs at prefill but not in decode steps (MLA's ``kv_b_proj``)."""
    return modules[path].phases == {"prefill"}


class RawLocations:
    """Raw locations as the names of one model: admitted into its specs when first used, each
    checked against the module tree as watched in one short generation (made on first need)."""

    def __init__(
        self,
        specs: dict[str, Spec],
        canonical_names: Sequence[str],
        watch: Callable[[], dict[str, ModuleRecord]],
        compiled: bool,
        tensor_parallel_size: int,
    ) -> None:
        self.specs = specs
        self.canonical_names = set(canonical_names)
        self.watch = watch
        self.compiled = compiled
        self.tensor_parallel_size = tensor_parallel_size

    @cached_property
    def module_records(self) -> dict[str, ModuleRecord]:
        """vLLM's module tree, path by path, with what each module did in one short generation
        (a prefill and a decode step): the facts behind raw locations' errors."""
        return self.watch()

    def admit(self, names: object, decoding: bool = False) -> None:
        """Make raw module locations among ``names`` (a name, a filter, or a list of names and
        ``(name, hook)`` pairs) known; ``decoding``: refuse modules that run at prefill only."""
        if isinstance(names, str) or callable(names) or names is None:
            names = [names]
        for item in names:  # type: ignore[union-attr]
            name = item[0] if isinstance(item, tuple) else item
            if not isinstance(name, str) or not RAW_NAME.fullmatch(name):
                continue
            if name.rsplit(".", 1)[0] in self.canonical_names:
                continue
            if name not in self.specs:
                check_raw_location(name, self.compiled, self.tensor_parallel_size)
                self.specs[name] = raw_spec(name, self.module_records)
            spec = self.specs[name]
            assert isinstance(spec, HookSpec)
            if decoding and prefill_only(spec.site.path, self.module_records):
                raise ValueError(
                    f"{spec.site.path} runs at prefill only (vLLM folds it into another "
                    f"kernel in decode steps): {name} has no value at generated positions"
                )
