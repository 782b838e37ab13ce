"""One mapping file per architecture; this package finds them and the one that serves a checkpoint.

Every module of this package with a ``MAPPING`` (an :class:`~vlens.names.mapping.ArchitectureMapping`)
is a mapping file: adding an architecture is adding one file here, and nothing else lists them.
"""

from __future__ import annotations

import difflib
import pkgutil
from importlib import import_module
from pathlib import Path

from transformers import AutoConfig, PretrainedConfig

from vlens.names.mapping import ArchitectureMapping, Spec

#: What the names of HuggingFace's causal-LM classes end with (stripped for a file name).
CLASS_SUFFIXES = ("ForCausalLM", "LMHeadModel")


def mapping_modules() -> dict[str, ArchitectureMapping]:
    """Each mapping file's module name (``llama``) → its ``MAPPING``, found by scanning the
    package (``__path__`` is read at each call: a folder added to it is scanned too)."""
    found = {}
    for module in pkgutil.iter_modules(__path__):
        if module.name.startswith("_"):
            continue
        mapping = getattr(import_module(f"{__name__}.{module.name}"), "MAPPING", None)
        if isinstance(mapping, ArchitectureMapping):
            found[module.name] = mapping
    return found


def all_mappings() -> list[ArchitectureMapping]:
    return list(mapping_modules().values())


def served() -> dict[str, ArchitectureMapping]:
    """Each HuggingFace architecture a mapping file serves → its mapping; an architecture two
    files claim is an error that names both."""
    owners: dict[str, str] = {}
    by_architecture = {}
    for module, mapping in mapping_modules().items():
        for architecture in mapping.architectures:
            if architecture in owners:
                first = owners[architecture]
                raise ValueError(
                    f"{architecture} is served by two mapping files, mappings/{first}.py and "
                    f"mappings/{module}.py: keep it in one"
                )
            owners[architecture] = module
            by_architecture[architecture] = mapping
    return by_architecture


def mapping_for(config: PretrainedConfig) -> ArchitectureMapping:
    """The mapping for ``config.architectures``, or an error saying which served family is
    nearest and how to add a mapping file for it."""
    wanted = list(getattr(config, "architectures", None) or [])
    mappings = served()
    for architecture in wanted:
        if architecture in mappings:
            return mappings[architecture]
    raise NotImplementedError(unserved_message(wanted))


def checkpoint_specs(folder: Path) -> dict[str, Spec]:
    """The hook names of the checkpoint in ``folder`` and their specs, from its config alone (no
    engine)."""
    config = AutoConfig.from_pretrained(folder)
    return mapping_for(config).expanded(config)


def unserved_message(wanted: list[str]) -> str:
    """Why no mapping serves ``wanted``, the nearest served architecture and its file, how to
    add one, and what vLLM itself offers for it."""
    modules = {a: name for name, m in mapping_modules().items() for a in m.architectures}
    listed = ", ".join(sorted(modules))
    if not wanted:
        return (
            f"the checkpoint's config.json names no architecture (no 'architectures' list), so "
            f"vlens cannot choose a mapping; served: {listed}"
        )
    architecture = wanted[0]
    nearest = nearest_served(architecture, list(modules))
    new_file = new_file_name(architecture)
    return (
        f"vlens has no mapping for {architecture}. Nearest served family: {nearest} "
        f"(mappings/{modules[nearest]}.py). To add it, write one file, mappings/{new_file}.py, "
        f"with MAPPING = {modules[nearest]}.MAPPING.member({architecture!r}, tiny_configs=...) "
        f"and only what differs (e.g. its own hook_specs: `vlens tree MODEL` prints the modules "
        f"vLLM builds); nothing else needs an edit. {vllm_support(architecture)} "
        f"Served: {listed}."
    )


def nearest_served(architecture: str, candidates: list[str]) -> str:
    """The served architecture whose vLLM class ``architecture``'s vLLM class is or derives from
    (the most specific one), else one vLLM implements in the same module, else the one whose
    name is closest."""
    lineage = _vllm_lineage(architecture)
    implementations = {c: vllm_implementation(c) for c in candidates}
    for ancestor in lineage:
        for candidate, implementation in implementations.items():
            if implementation == ancestor:
                return candidate
    if lineage:
        module = lineage[0][0]
        for candidate, implementation in implementations.items():
            if implementation is not None and implementation[0] == module:
                return candidate
    return max(candidates, key=lambda c: difflib.SequenceMatcher(None, architecture, c).ratio())


def new_file_name(architecture: str) -> str:
    """``Phi3ForCausalLM`` → ``phi3``."""
    for suffix in CLASS_SUFFIXES:
        architecture = architecture.removesuffix(suffix)
    return architecture.lower()


def vllm_support(architecture: str) -> str:
    """What vLLM's model registry says about ``architecture``: native, or only through its
    Transformers backend (``model_impl="transformers"``), or not listed."""
    implementation = vllm_implementation(architecture)
    if implementation is None:
        return (
            f"vLLM lists no implementation of {architecture}; its Transformers backend "
            f'(model_impl="transformers") may serve it, with HuggingFace\'s module tree, which '
            f"a mapping would then name."
        )
    module = implementation[0]
    if module.rsplit(".", 1)[-1] == "transformers":
        return (
            f"vLLM serves {architecture} through its Transformers backend "
            f'(model_impl="transformers"), with HuggingFace\'s module tree, which a mapping '
            f"would then name."
        )
    return f"vLLM implements {architecture} natively ({module})."


def vllm_implementation(architecture: str) -> tuple[str, str] | None:
    """The module and class vLLM's model registry builds ``architecture`` with, or None."""
    from vllm.model_executor.models.registry import ModelRegistry

    entry = ModelRegistry.models.get(architecture)
    if entry is None:
        return None
    if hasattr(entry, "model_cls"):  # registered as a class (out-of-tree models)
        return entry.model_cls.__module__, entry.model_cls.__name__
    return entry.module_name, entry.class_name


def _vllm_lineage(architecture: str) -> list[tuple[str, str]]:
    """vLLM's class for ``architecture`` and its base classes, most specific first, as (module,
    class) pairs; just the class where its module does not import here; empty if unlisted."""
    from vllm.model_executor.models.registry import ModelRegistry

    implementation = vllm_implementation(architecture)
    if implementation is None:
        return []
    try:
        model_class = ModelRegistry.models[architecture].load_model_cls()
    except ImportError:
        return [implementation]
    return [(cls.__module__, cls.__name__) for cls in model_class.__mro__]
