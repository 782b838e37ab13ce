"""Raw vLLM locations as hook names: any module path of ``print(model)`` plus ``.output``,
``.input`` or ``.inputs`` — the escape hatch where no canonical name exists yet — and any
operation inside a module's forward, ``PATH.source.OP`` plus the same
(:mod:`vlens.runtime.sites.source`; ``model.source(PATH)`` lists them).

- ``PATH.output``: what the module returns. vLLM's linear layers return ``(tensor, bias)``; the
  hook sees the tensor (element 0). ``PATH.output.N`` picks element ``N`` of a tuple.
- ``PATH.input``: the first argument (positional, else the first keyword). ``PATH.input.N`` /
  ``PATH.input.NAME`` pick one argument by position or keyword.
- ``PATH.inputs``: every argument of the call, read into the cache as one dict by argument
  (:meth:`RawLocations.grouped`); a hook takes one argument's spelling.

Values are narrowed per request like every name (rows first: ``[1, pos, ...]`` in a hook),
copied when cached, and writable: an edit is copied into vLLM's own tensor.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property

from torch import Tensor

from vlens.names.mapping import HookSpec, Spec
from vlens.names.resolve import UnknownHookName
from vlens.runtime.sites.source import SOURCE, Operation, missing
from vlens.runtime.transfer.messages import ModuleRecord
from vlens.runtime.vocabulary.locations import Site, SiteCall

RAW_NAME = re.compile(
    r"(?P<path>[\w.]+?)(?:\.source\.(?P<operation>\w+))?\.(?P<kind>output|inputs|input)"
    r"(?:\.(?P<part>\w+))?"
)

#: the operations of a module's forward, by its path, or why it has none to list
OperationLister = Callable[[str], list[Operation] | str]


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


def raw_spec(
    name: str, modules: dict[str, ModuleRecord], operations: OperationLister | None = None
) -> HookSpec:
    """The spec of a raw location, or an error saying why it cannot be one."""
    found = RAW_NAME.fullmatch(name)
    if found is None:
        raise UnknownHookName(name, modules, "this model's module tree")
    path, kind, part = found["path"], found["kind"], found["part"]
    record = module_record(path, modules)
    refuse_unusable(path, record)
    if found["operation"] is not None:
        assert operations is not None, "no way to list a forward's operations"
        return operation_spec(name, path, found["operation"], kind, part, operations(path))
    if kind == "inputs":
        spellings = [f"{path}.input.{i}" for i in range(record.positional)]
        spellings += [f"{path}.input.{keyword}" for keyword in record.keywords]
        raise ValueError(
            f"{name}: a hook function takes one tensor, and a call's arguments are several; "
            f"hook one of them: {', '.join(spellings)} (run_with_cache reads {name} as a dict "
            f"by argument)"
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


def module_record(path: str, modules: dict[str, ModuleRecord]) -> ModuleRecord:
    """What the module at ``path`` did while watched; an error listing near paths if vLLM's
    tree has no such module."""
    record = modules.get(path)
    if record is None:
        raise UnknownHookName(
            path, modules, "vLLM's tree for this model", "print(model) shows it", "a module"
        )
    return record


def operation_spec(
    name: str, path: str, operation: str, kind: str, part: str | None,
    listed: list[Operation] | str,
) -> HookSpec:
    """The spec of ``PATH.source.OP.output`` / ``.input``: one call inside the module's forward."""
    if isinstance(listed, str):
        raise ValueError(f"{name}: {listed}")
    if operation not in {op.name for op in listed if not op.repeated}:
        raise ValueError(missing(path, operation, listed))
    site_path = f"{path}{SOURCE}{operation}"
    if kind == "inputs":
        raise ValueError(
            f"{name}: a call's arguments are several values and a cache holds one tensor per "
            f"name; name one: {site_path}.input.0 (by position) or {site_path}.input.KEYWORD"
        )
    if kind == "output":
        return HookSpec(Site(site_path, "output"), RawOutput(int(part) if part else None), "pos ...")
    if part is None or part.isdigit():
        return HookSpec(Site(site_path, "input"), RawInput(int(part or 0)), "pos ...")
    return HookSpec(Site(site_path, "input"), RawInput(-1, part), "pos ...")


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


@dataclass(frozen=True)
class SourceListing:
    """The operations of one module's forward as vLLM runs it (``model.source(path)``), each a
    location: ``print`` shows them with their source lines."""

    path: str
    operations: tuple[Operation, ...]

    @property
    def names(self) -> list[str]:
        """The location of each operation offered (its result; ``.input`` names its arguments)."""
        return [f"{self.path}{SOURCE}{op.name}.output" for op in self.operations if not op.repeated]

    def __iter__(self):
        return iter(self.names)

    def __repr__(self) -> str:
        width = max((len(op.name) for op in self.operations), default=0)
        lines = [f"{self.path}.source: each NAME below is {self.path}.source.NAME.output "
                 f"(its result; .output.N: element N) or .input.N / .input.KEYWORD"]
        for op in self.operations:
            note = "   (in a loop: not offered)" if op.repeated else ""
            lines.append(f"  {op.name:<{width}}  line {op.line}: {op.text}{note}")
        return "\n".join(lines)


class RawLocations:
    """Raw locations as the names of one model: admitted into its specs when first used, each
    checked against the module tree as watched in one short generation (made on first need)."""

    def __init__(
        self,
        specs: dict[str, Spec],
        canonical_names: Sequence[str],
        watch: Callable[[], dict[str, ModuleRecord]],
        check: Callable[[str], None],
        operations: OperationLister,
    ) -> None:
        """``check``: refuses a raw location the engine cannot hook (:meth:`~vlens.names.rules.NameRules.check_raw_location`)."""
        self.specs = specs
        self.canonical_names = canonical_names
        self.watch = watch
        self.check = check
        self.operations = operations

    @cached_property
    def module_records(self) -> dict[str, ModuleRecord]:
        """vLLM's module tree, path by path, with what each module did in one short generation
        (a prefill and a decode step): the facts behind raw locations' errors."""
        return self.watch()

    def record_of(self, path: str) -> ModuleRecord:
        """What the module at ``path`` did while watched; an error listing near paths if there
        is none."""
        return module_record(path, self.module_records)

    def source(self, path: str) -> SourceListing:
        """The operations of the forward of the module at ``path``."""
        self.record_of(path)
        listed = self.operations(path)
        if isinstance(listed, str):
            raise ValueError(f"{path}: {listed}")
        return SourceListing(path, tuple(listed))

    def grouped(self, names: object) -> tuple[object, dict[str, dict[str, str]]]:
        """``names`` (a names filter) with each module's ``PATH.inputs`` replaced by one name per
        argument of its call (``PATH.input.NAME`` by the parameter it fills, ``PATH.input.N``
        past them), and those groups: ``{"PATH.inputs": {argument: name}}``."""
        single = isinstance(names, str)
        if not (single or isinstance(names, (list, tuple))):
            return names, {}
        groups: dict[str, dict[str, str]] = {}
        expanded: list[str] = []
        for name in [names] if single else names:  # type: ignore[union-attr]
            found = RAW_NAME.fullmatch(name) if isinstance(name, str) else None
            if found is None or found["kind"] != "inputs" or found["operation"] or found["part"]:
                expanded.append(name)
                continue
            path = found["path"]
            record = self.record_of(path)
            arguments = [
                record.parameters[i] if i < len(record.parameters) else str(i)
                for i in range(record.positional)
            ] + list(record.keywords)
            arguments = [argument for argument in arguments if argument in record.tensors]
            groups[name] = {argument: f"{path}.input.{argument}" for argument in arguments}
            expanded += [part for part in groups[name].values() if part not in expanded]
        return expanded, groups

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
                self.check(name)
                self.specs[name] = raw_spec(name, self.module_records, self.operations)
            spec = self.specs[name]
            assert isinstance(spec, HookSpec)
            if decoding and prefill_only(spec.site.path, self.module_records):
                raise ValueError(
                    f"{spec.site.path} runs at prefill only (vLLM folds it into another "
                    f"kernel in decode steps): {name} has no value at generated positions"
                )
