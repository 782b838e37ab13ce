"""A notebook's code cells, made runnable as plain Python, and what each of them asks of a model.

Per cell: IPython magics and shell lines (``%pip``, ``!pip``, ``%autoreload``) become ``pass``;
every model-loading call (``TransformerBridge.boot_transformers(...)``,
``HookedTransformer.from_pretrained(...)``, ...) becomes ``__notebook_load__("<loader>", ...)``
and every ``X.enable_compatibility_mode(...)`` becomes ``__notebook_compat__(X, ...)``, so the
runner decides which model a cell gets; ``HookedTransformer`` (gone from TransformerLens 4,
used by the notebooks only to load models) is dropped from ``from transformer_lens import``.

The static side, read from the source alone: the names a cell binds at notebook level (to tell a
cascade from a failure), the model API it touches (``model.to_tokens(prepend_bos=)``,
``cache.apply_ln_to_stack(layer=, pos_slice=)``, ``utils.test_prompt(model)``), and whether it
needs what this machine has not: gradients, or downloads other than the model being swapped.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

LOAD_FUNCTION = "__notebook_load__"
COMPAT_FUNCTION = "__notebook_compat__"

#: ``Class.method`` calls that load a model.
LOADERS = {
    "TransformerBridge": {"boot_transformers", "boot"},
    "HookedTransformer": {"from_pretrained", "from_pretrained_no_processing"},
    "HookedSAETransformer": {"from_pretrained", "from_pretrained_no_processing"},
    "HookedVLLM": {"from_pretrained"},
}
COMPAT_METHODS = {"enable_compatibility_mode"}
#: Names dropped from ``from <module> import ...``: the loading classes TransformerLens 4 removed.
DROPPED_IMPORTS = {"transformer_lens": {"HookedTransformer", "HookedTransformerConfig"}}

#: Calls that download data or other models (the swapped model's loader excepted).
NETWORK_CALLS = {
    "load_dataset",
    "hf_hub_download",
    "snapshot_download",
    "make_pile_data_loader",
    "make_owt_data_loader",
    "make_wiki_data_loader",
    "make_code_data_loader",
    "urlopen",
}
NETWORK_FROM_PRETRAINED = re.compile(r"^Auto\w+$")
#: Calls that need autograd (the runner keeps ``torch.set_grad_enabled(False)`` as found).
GRADIENT_METHODS = {"backward", "requires_grad_", "zero_grad"}
GRADIENT_MODULES = {"optim"}

MIRROR = Path("/work/.mirror/TransformerLensOrg+TransformerLens/repo")
COPIES = Path("/tmp/notebooks")


@dataclass
class Cell:
    """One code cell: its source, the runnable statements, and what it statically needs."""

    index: int
    source: str
    first_line: str
    statements: list[ast.stmt] = field(default_factory=list)
    syntax_error: str | None = None
    bound: set[str] = field(default_factory=set)
    model_calls: list[str] = field(default_factory=list)
    skip_reason: str | None = None
    guarded_by_ci: bool = False


@dataclass(frozen=True)
class Notebook:
    name: str
    origin: str  # where the file came from: a path, or mirror commit + path
    cells: list[Cell]


# ---- reading -----------------------------------------------------------------------------------


def from_mirror(mirror: Path, file: str) -> tuple[str, str] | None:
    """``file`` at HEAD of the git directory ``mirror``, and HEAD's short commit; None where
    the mirror or the file is missing."""
    if not mirror.is_dir():
        return None
    shown = subprocess.run(["git", f"--git-dir={mirror}", "show", f"HEAD:{file}"],
                           check=False, capture_output=True, text=True)
    if shown.returncode != 0:
        return None
    commit = subprocess.run(["git", f"--git-dir={mirror}", "rev-parse", "--short", "HEAD"],
                            check=False, capture_output=True, text=True).stdout.strip()
    return shown.stdout, commit


def read_notebook(ref: str, mirror: Path = MIRROR) -> tuple[str, str, dict]:
    """``ref`` is an ``.ipynb`` path, or a demo's name (``Main_Demo``) looked up in the
    TransformerLens mirror's ``demos/`` at HEAD, then in :data:`COPIES`."""
    path = Path(ref)
    if path.suffix == ".ipynb" and path.is_file():
        return path.stem, str(path.resolve()), json.loads(path.read_text())
    name = path.stem if path.suffix == ".ipynb" else ref
    found = from_mirror(mirror, f"demos/{name}.ipynb")
    if found is not None:
        text, commit = found
        origin = f"TransformerLensOrg/TransformerLens@{commit}:demos/{name}.ipynb"
        return name, origin, json.loads(text)
    copy = COPIES / f"{name}.ipynb"
    if copy.is_file():
        return name, str(copy), json.loads(copy.read_text())
    raise FileNotFoundError(
        f"{ref}: not a notebook file, nor demos/{name}.ipynb in {mirror} or {COPIES}"
    )


def code_sources(notebook: dict) -> list[str]:
    sources = []
    for cell in notebook["cells"]:
        if cell["cell_type"] == "code":
            source = cell["source"]
            sources.append("".join(source) if isinstance(source, list) else source)
    return sources


def load(ref: str, mirror: Path = MIRROR) -> Notebook:
    name, origin, raw = read_notebook(ref, mirror)
    tracked = Tracked()
    cells = [prepare(index, source, tracked) for index, source in enumerate(code_sources(raw))]
    return Notebook(name, origin, cells)


# ---- making a cell runnable --------------------------------------------------------------------


def first_line(source: str) -> str:
    for line in source.splitlines():
        text = line.strip()
        if text and not text.startswith("# NBVAL"):
            return text
    return ""


def drop_magics(source: str) -> str:
    """IPython line magics, cell magics and shell escapes become ``pass`` (same indentation,
    so an ``if IN_COLAB:`` block around ``%pip install`` stays valid)."""
    lines = []
    for line in source.splitlines():
        stripped = line.lstrip()
        if stripped.startswith(("%", "!")):
            line = line[: len(line) - len(stripped)] + "pass"
        lines.append(line)
    return "\n".join(lines)


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def loader_of(call: ast.Call) -> str | None:
    """``"TransformerBridge.boot_transformers"`` for a model-loading call, else None."""
    func = call.func
    if (
        isinstance(func, ast.Attribute)
        and isinstance(func.value, ast.Name)
        and func.attr in LOADERS.get(func.value.id, ())
    ):
        return f"{func.value.id}.{func.attr}"
    return None


class SwapLoading(ast.NodeTransformer):
    """Loading calls to :data:`LOAD_FUNCTION`, compatibility calls to :data:`COMPAT_FUNCTION`,
    and the removed loading classes out of TransformerLens imports."""

    def visit_Call(self, node: ast.Call) -> ast.AST:
        self.generic_visit(node)
        loader = loader_of(node)
        if loader is not None:
            args = [ast.Constant(loader), *node.args]
            return ast.Call(ast.Name(LOAD_FUNCTION, ast.Load()), args, node.keywords)
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr in COMPAT_METHODS:
            args = [func.value, *node.args]
            return ast.Call(ast.Name(COMPAT_FUNCTION, ast.Load()), args, node.keywords)
        return node

    def visit_ImportFrom(self, node: ast.ImportFrom) -> ast.AST:
        dropped = DROPPED_IMPORTS.get(node.module or "", set())
        kept = [alias for alias in node.names if alias.name not in dropped]
        if len(kept) == len(node.names):
            return node
        return ast.ImportFrom(node.module, kept, node.level) if kept else ast.Pass()


def prepare(index: int, source: str, tracked: Tracked) -> Cell:
    cell = Cell(index, source, first_line(source))
    try:
        tree = ast.parse(drop_magics(source))
    except SyntaxError as error:
        cell.syntax_error = f"SyntaxError: {error.msg} (line {error.lineno})"
        return cell
    _link_parents(tree)
    cell.bound = bound_names(tree.body)
    tracked.update(tree)
    cell.model_calls = model_calls(tree, tracked)
    cell.skip_reason = static_skip(tree)
    cell.guarded_by_ci = any(
        isinstance(node, ast.If)
        and any(isinstance(n, ast.Name) and n.id == "IN_GITHUB" for n in ast.walk(node.test))
        for node in ast.walk(tree)
    )
    swapped = ast.fix_missing_locations(SwapLoading().visit(tree))
    cell.statements = list(swapped.body)
    return cell


# ---- static facts ------------------------------------------------------------------------------


def _targets(target: ast.AST) -> Iterable[str]:
    if isinstance(target, ast.Name):
        yield target.id
    elif isinstance(target, (ast.Tuple, ast.List)):
        for element in target.elts:
            yield from _targets(element)
    elif isinstance(target, ast.Starred):
        yield from _targets(target.value)


def bound_names(statements: list[ast.stmt]) -> set[str]:
    """Names a cell binds in the notebook's namespace (not inside functions or classes)."""
    names: set[str] = set()
    for statement in statements:
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(statement.name)
            continue
        if isinstance(statement, (ast.Import, ast.ImportFrom)):
            for alias in statement.names:
                names.add((alias.asname or alias.name).split(".")[0])
            continue
        if isinstance(statement, ast.Assign):
            for target in statement.targets:
                names.update(_targets(target))
        elif isinstance(statement, (ast.AnnAssign, ast.AugAssign, ast.For, ast.AsyncFor)):
            names.update(_targets(statement.target))
        elif isinstance(statement, (ast.With, ast.AsyncWith)):
            for item in statement.items:
                if item.optional_vars is not None:
                    names.update(_targets(item.optional_vars))
        for child in ("body", "orelse", "finalbody"):
            names.update(bound_names(getattr(statement, child, []) or []))
        for handler in getattr(statement, "handlers", []) or []:
            names.update(bound_names(handler.body))
    return names


def static_skip(tree: ast.Module) -> str | None:
    """Why a cell cannot run here whatever the backend: gradients, or downloads."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in GRADIENT_METHODS | GRADIENT_MODULES:
            return f"needs gradients (.{node.attr})"
        if isinstance(node, ast.Call):
            name = _dotted(node.func) or ""
            last = name.rsplit(".", 1)[-1]
            if name.endswith("set_grad_enabled") and _is_true(node.args):
                return "needs gradients (set_grad_enabled(True))"
            if last in NETWORK_CALLS:
                return f"needs network ({name})"
            head = name.rsplit(".", 2)
            if (
                last == "from_pretrained"
                and len(head) >= 2
                and NETWORK_FROM_PRETRAINED.match(head[-2])
            ):
                return f"needs network ({name}: another model from the hub)"
    return None


def _is_true(args: list[ast.expr]) -> bool:
    return bool(args) and isinstance(args[0], ast.Constant) and args[0].value is True


def _link_parents(tree: ast.AST) -> None:
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            child.parent = node  # type: ignore[attr-defined]


@dataclass
class Tracked:
    """Variables that hold the model (bound from a loading call) or a cache (the second element
    of ``... = model.run_with_cache(...)``, or any name ending in ``cache``), cell after cell."""

    models: set[str] = field(default_factory=set)
    caches: set[str] = field(default_factory=set)

    def is_model(self, name: str) -> bool:
        return name in self.models

    def is_cache(self, name: str) -> bool:
        return name in self.caches or name.endswith("cache")

    def update(self, tree: ast.Module) -> None:
        for node in ast.walk(tree):
            if not isinstance(node, ast.Assign):
                continue
            value = node.value
            loads = isinstance(value, ast.Call) and loader_of(value) is not None
            for target in node.targets:
                if isinstance(target, ast.Name):
                    if loads:
                        self.models.add(target.id)
                    else:
                        self.models.discard(target.id)
                if (
                    isinstance(target, ast.Tuple)
                    and len(target.elts) == 2
                    and _runs_with_cache(value)
                ):
                    second = target.elts[1]
                    if isinstance(second, ast.Name):
                        self.caches.add(second.id)


def _runs_with_cache(value: ast.AST) -> bool:
    return (
        isinstance(value, ast.Call)
        and isinstance(value.func, ast.Attribute)
        and value.func.attr == "run_with_cache"
    )


#: Functions that take the model without using its API.
NOT_API = {"print", "len", "isinstance", "type", "id", "repr", "str", "append"}


def _keywords(call: ast.Call) -> str:
    return ", ".join(f"{kw.arg}=" for kw in call.keywords if kw.arg)


def _chain(node: ast.AST) -> tuple[str, str] | None:
    """(root variable, ``.a[].b`` path) of an attribute/subscript chain on a variable."""
    parts: list[str] = []
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        parts.append(f".{node.attr}" if isinstance(node, ast.Attribute) else "[]")
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return node.id, "".join(reversed(parts))


def model_calls(tree: ast.Module, tracked: Tracked) -> list[str]:
    """The model and cache API a cell touches, in source order, each once: attribute paths on a
    model or cache variable (with the keywords of a call), direct calls of the model, loading
    calls, and calls that hand the model to a function."""
    found: list[str] = []

    def add(text: str) -> None:
        if text not in found:
            found.append(text)

    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            loader = loader_of(node)
            if loader is not None:
                add(f"load: {loader}")
                continue
            func = node.func
            if isinstance(func, ast.Name) and tracked.is_model(func.id):
                add(f"model({_keywords(node)})")
            handed = [a for a in node.args if isinstance(a, ast.Name) and tracked.is_model(a.id)]
            name = _dotted(func) or ""
            takes_model = handed and name.rsplit(".", 1)[-1] not in NOT_API
            if takes_model and not tracked.is_model(name.split(".")[0]):
                add(f"{name}(model)")
        if not isinstance(node, (ast.Attribute, ast.Subscript)):
            continue
        parent = getattr(node, "parent", None)
        if isinstance(parent, (ast.Attribute, ast.Subscript)) and parent.value is node:
            continue  # reported as part of the longer chain
        chain = _chain(node)
        if chain is None:
            continue
        root, path = chain
        if tracked.is_model(root):
            label = "model" + re.sub(r"(\[\])+$", "", path)
        elif tracked.is_cache(root):
            # cache[...] is the cache's API; what follows it is the tensor's.
            label = "cache" + ("[]" if path.startswith("[]") else path.split("[]")[0])
        else:
            continue
        if label.endswith(tuple(f".{m}" for m in COMPAT_METHODS)):
            label = f"load: {label}"
        if isinstance(parent, ast.Call) and parent.func is node and not label.endswith("[]"):
            label += f"({_keywords(parent)})"
        add(label)
    return found
