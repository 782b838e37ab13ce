"""The layers of vlens: each package imports only its own modules and the packages of the layers
below it, and no module imports itself back through others. Every import counts: at the top of a
module, inside a function (imported late, for speed or for a worker) and for type checking."""

import ast
import itertools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: Lowest first. A package of one layer imports packages of lower layers only (not its
#: siblings); ``vlens`` is the package's own ``__init__``, the front door.
LAYERS = [
    ["vlens.sae"],  # SAELens's SAE format and numerics: nothing else of vlens
    ["vlens.runtime"],  # the leaf a vLLM worker imports
    ["vlens.names"],  # the vocabulary: mapping language, resolver, rules, weight views
    ["vlens.mappings"],  # one file per architecture
    ["vlens.engine"],  # a checkpoint, a call's plans, vLLM's engine, assembled values
    ["vlens.hooked"],  # TransformerLens's HookedTransformer surface
    ["vlens.analysis", "vlens.patching", "vlens.store", "vlens.serve"],  # built on the model
    ["vlens.testing"],  # tiny checkpoints, the generated tables
    ["vlens.parity"],  # the proof against HuggingFace and TransformerLens
    ["vlens.cli", "vlens"],  # the command line and the front door
]


def module_files() -> dict[str, Path]:
    """Every module of vlens by its dotted name (``mappings/`` and ``parity/`` ship inside it)."""
    found = {}
    for folder, package in [("vlens", "vlens"), ("mappings", "vlens.mappings"),
                            ("parity", "vlens.parity")]:
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    return found


def imports(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """The vlens modules that the module ``name`` at ``path`` imports, anywhere in it."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            submodules = [f"{base}.{alias.name}" for alias in node.names]
            # names that are not submodules come from the package (or module) itself
            targets = submodules + ([base] if not set(submodules) <= modules.keys() else [])
        elif isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            continue
        for target in targets:
            if target in modules and target != name:
                found.add(target)
    return found


def graph() -> dict[str, set[str]]:
    modules = module_files()
    return {name: imports(path, name, modules) for name, path in modules.items()}


def package_of(module: str) -> str:
    """The layered package a module belongs to (the longest listed prefix)."""
    listed = [package for layer in LAYERS for package in layer]
    return max((p for p in listed if module == p or module.startswith(p + ".")), key=len)


def test_every_module_is_in_a_layer():
    assert all(package_of(module) for module in module_files())


def test_each_package_imports_only_the_layers_below_it():
    level = {package: index for index, layer in enumerate(LAYERS) for package in layer}
    climbs = []
    for module, targets in graph().items():
        own = package_of(module)
        for target in targets:
            other = package_of(target)
            if other != own and level[other] >= level[own]:
                climbs.append(f"{module} -> {target}")
    assert not climbs, "imports that climb a layer (or cross to a sibling):\n" + "\n".join(climbs)


def test_no_import_cycles():
    edges = graph()
    cycles = set()
    for start in edges:  # depth-first from each module: a path back to it is a cycle
        stack = [(start, [start])]
        seen = set()
        while stack:
            module, path = stack.pop()
            for target in edges[module]:
                if target == start:
                    cycles.add(" -> ".join(min(rotations(path), key=str)))
                elif target not in seen:
                    seen.add(target)
                    stack.append((target, [*path, target]))
    assert not cycles, "import cycles:\n" + "\n".join(sorted(cycles))


def rotations(path: list[str]) -> list[tuple[str, ...]]:
    return [tuple(itertools.islice(itertools.cycle(path), i, i + len(path)))
            for i in range(len(path))]


def test_every_package_is_shipped():
    """``pyproject.toml`` lists its packages: a folder of modules not listed would be missing from
    a built wheel (an editable install finds it anyway)."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    packages = {name for name, path in module_files().items() if path.name == "__init__.py"}
    assert packages == listed


def test_every_module_is_on_the_map():
    """``docs/how-it-works.md`` names every module of vlens by its path in its package."""
    page = (ROOT / "docs" / "how-it-works.md").read_text()
    missing = []
    for name, path in module_files().items():
        if name.startswith(("vlens.mappings.", "vlens.parity")) or path.name == "__init__.py":
            continue  # mapping files are listed by the architectures table; parity by its page
        shown = path.relative_to(ROOT / "vlens").as_posix()
        if shown not in page:
            missing.append(shown)
    assert not missing, f"not on docs/how-it-works.md's map: {missing}"
