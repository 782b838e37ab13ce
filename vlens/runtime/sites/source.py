"""The operations inside a module's forward as locations (``PATH.source.OP``): every call the
forward's source makes, named by what it calls and a counter (``qkv_split_0``,
``self_rotary_emb_0``, ``self_attn_0``).

The forward's source is parsed, never run as text: each call ``f(args)`` becomes
``operation("f_0", f)(args)``, which is ``f`` itself unless a site is installed at that
operation; the rewritten function is compiled against the original's globals and closure and
bound to one module instance only while some site of it is installed, so a module without one
runs vLLM's own forward. An installed site sees ``(args, kwargs, output)`` of its call, as a torch
hook sees a module's, and edits in place.

Names follow the call's target: dots become underscores (``torch.cat`` → ``torch_cat``), a
subscript or a call result in the target keeps the names around it (``self.layers[i]`` →
``self_layers``); the counter counts calls of that name in the order they run. Calls inside a
loop or a comprehension run more than once per forward and are listed, not offered.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

Handler = Callable[[tuple, dict, Any], None]

#: between a module's path and an operation's name in a location
SOURCE = ".source."

#: the name the rewritten forward calls each operation through
_HOOK = "__vlens_operation__"


@dataclass(frozen=True)
class Operation:
    """One call in a forward's source: its location name, the source line it is on (in the
    forward's file), that line's text, and whether it runs inside a loop (not offered)."""

    name: str
    line: int
    text: str
    repeated: bool = False


def _target_name(node: ast.expr) -> str:
    """``self.rotary_emb`` → ``self_rotary_emb``; ``qkv.split`` → ``qkv_split``."""
    parts: list[str] = []
    while True:
        if isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        elif isinstance(node, ast.Name):
            parts.append(node.id)
            break
        elif isinstance(node, (ast.Subscript, ast.Call)):
            node = node.value if isinstance(node, ast.Subscript) else node.func
        else:
            break
    return "_".join(reversed(parts)) or "call"


class _Rewriter(ast.NodeTransformer):
    """Names every call in the order it runs (arguments before the call that takes them) and
    routes it through :data:`_HOOK`."""

    def __init__(self, lines: list[str], first_line: int) -> None:
        self.lines = lines
        self.first_line = first_line
        self.counts: dict[str, int] = {}
        self.operations: list[Operation] = []
        self.loops = 0

    def _loop(self, node: ast.AST) -> ast.AST:
        self.loops += 1
        try:
            return self.generic_visit(node)
        finally:
            self.loops -= 1

    visit_For = visit_AsyncFor = visit_While = _loop
    visit_ListComp = visit_SetComp = visit_DictComp = visit_GeneratorExp = _loop

    def _unchanged(self, node: ast.AST) -> ast.AST:
        return node  # a function or class defined inside: runs when called, maybe never

    visit_Lambda = visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _unchanged

    def visit_Call(self, node: ast.Call) -> ast.AST:
        self.generic_visit(node)  # inner calls first: they run first
        base = _target_name(node.func)
        number = self.counts.get(base, 0)
        self.counts[base] = number + 1
        name = f"{base}_{number}"
        line = node.lineno
        self.operations.append(
            Operation(name, self.first_line + line - 1, self.lines[line - 1].strip(), self.loops > 0)
        )
        routed = ast.Call(
            func=ast.Name(_HOOK, ast.Load()), args=[ast.Constant(name), node.func], keywords=[]
        )
        return ast.copy_location(ast.Call(routed, node.args, node.keywords), node)


@dataclass
class _Rewritten:
    operations: list[Operation]
    make: Callable[..., Callable]  # (route, *closure values) -> the forward function
    closure: tuple[Any, ...]


_rewritten: dict[type, _Rewritten] = {}


def _rewrite(cls: type) -> _Rewritten:
    """The forward of ``cls`` with every call routed, once per class."""
    if cls in _rewritten:
        return _rewritten[cls]
    forward = cls.forward
    try:
        source = textwrap.dedent(inspect.getsource(forward))
        lines, first_line = inspect.getsourcelines(forward)
    except (OSError, TypeError) as error:
        raise LookupError(f"{cls.__name__}.forward has no Python source to list ({error})") from None
    tree = ast.parse(source)
    function = tree.body[0]
    if not isinstance(function, ast.FunctionDef):
        raise LookupError(f"{cls.__name__}.forward is not a plain function")
    function.decorator_list = []  # a decorated forward is the decorator's: see the check below
    if type(forward) is not types.FunctionType or forward.__code__.co_name != function.name:
        raise LookupError(f"{cls.__name__}.forward is wrapped by a decorator: its source is not "
                          f"what runs")
    rewriter = _Rewriter(source.splitlines(), first_line)
    function.body = [rewriter.visit(statement) for statement in function.body]
    code = forward.__code__
    # def make(route, *closure): def forward(...): ...; return forward -- the closure kept
    module = ast.parse(f"def make({', '.join([_HOOK, *code.co_freevars])}):\n"
                       f"    return {function.name}\n")
    maker = module.body[0]
    assert isinstance(maker, ast.FunctionDef)
    maker.body.insert(0, function)
    ast.increment_lineno(module, first_line - 1)
    ast.fix_missing_locations(module)
    namespace: dict[str, Any] = {}
    exec(compile(module, code.co_filename, "exec"), forward.__globals__, namespace)
    closure = tuple(cell.cell_contents for cell in (forward.__closure__ or ()))
    made = _Rewritten(rewriter.operations, namespace["make"], closure)
    _rewritten[cls] = made
    return made


def operations(module: nn.Module) -> list[Operation]:
    """The operations of ``module``'s forward, in the order they run."""
    return list(_rewrite(type(module)).operations)


class _Sites:
    """The operation sites installed on one module instance."""

    def __init__(self, module: nn.Module) -> None:
        made = _rewrite(type(module))
        self.offered = {op.name for op in made.operations if not op.repeated}
        self.before: dict[str, list[Handler]] = {}
        self.after: dict[str, list[Handler]] = {}
        function = made.make(self.route, *made.closure)
        function.__defaults__ = type(module).forward.__defaults__
        function.__kwdefaults__ = type(module).forward.__kwdefaults__
        self.forward = types.MethodType(function, module)

    def route(self, name: str, function: Callable) -> Callable:
        before, after = self.before.get(name), self.after.get(name)
        if not before and not after:
            return function

        def call(*args: Any, **kwargs: Any) -> Any:
            for handler in before or ():
                handler(args, kwargs, None)
            output = function(*args, **kwargs)
            for handler in after or ():
                handler(args, kwargs, output)
            return output

        return call

    def empty(self) -> bool:
        return not any(self.before.values()) and not any(self.after.values())


class OperationHandle:
    """Removes one installed operation site (as a torch hook's handle does)."""

    def __init__(self, module: nn.Module, table: dict[str, list[Handler]], name: str,
                 handler: Handler) -> None:
        self.module, self.table, self.name, self.handler = module, table, name, handler

    def remove(self) -> None:
        handlers = self.table.get(self.name, [])
        if self.handler in handlers:
            handlers.remove(self.handler)
        sites: _Sites | None = getattr(self.module, "_vlens_operation_sites", None)
        if sites is not None and sites.empty():
            del self.module._vlens_operation_sites
            self.module.__dict__.pop("forward", None)  # vLLM's own forward again


def install_operation_site(
    module: nn.Module, path: str, operation: str, after: bool, handler: Handler
) -> OperationHandle:
    """Call ``handler`` with ``(args, kwargs, output)`` of ``operation`` in ``module``'s forward
    (``output`` None before the call, when ``after`` is False)."""
    sites: _Sites | None = getattr(module, "_vlens_operation_sites", None)
    if sites is None:
        sites = _Sites(module)
        if operation not in sites.offered:
            raise LookupError(missing(path, operation, operations(module)))
        module._vlens_operation_sites = sites
        module.forward = sites.forward
    elif operation not in sites.offered:
        raise LookupError(missing(path, operation, operations(module)))
    table = sites.after if after else sites.before
    table.setdefault(operation, []).append(handler)
    return OperationHandle(module, table, operation, handler)


def missing(path: str, operation: str, listed: list[Operation]) -> str:
    """Why ``operation`` is not a location of ``path``'s forward, with the ones that are."""
    import difflib

    repeated = {op.name for op in listed if op.repeated}
    if operation in repeated:
        return (
            f"{path}.source.{operation} runs inside a loop (more than once per forward), so it has "
            f"no one value per call; hook the module it calls, or a name outside the loop"
        )
    offered = [op.name for op in listed if not op.repeated]
    near = difflib.get_close_matches(operation, offered, n=3, cutoff=0.5)
    hint = f" Did you mean: {', '.join(near)}?" if near else ""
    return (
        f"{path}.source has no operation {operation!r}.{hint} Its operations: "
        f"{', '.join(offered) or '(none)'}"
    )
