"""One mapping file per architecture; this module finds the one that serves a checkpoint."""

from importlib import import_module

from transformers import PretrainedConfig

from vlens.mapping import ArchitectureMapping

MAPPING_MODULES = ("llama", "qwen3", "gpt2", "deepseek")


def all_mappings() -> list[ArchitectureMapping]:
    return [import_module(f"vlens.mappings.{name}").MAPPING for name in MAPPING_MODULES]


def mapping_for(config: PretrainedConfig) -> ArchitectureMapping:
    """The mapping for ``config.architectures``, or an error naming the supported ones."""
    wanted = list(getattr(config, "architectures", None) or [])
    for mapping in all_mappings():
        if any(arch in mapping.architectures for arch in wanted):
            return mapping
    supported = sorted(a for m in all_mappings() for a in m.architectures)
    raise NotImplementedError(
        f"vlens has no mapping for architecture {wanted or '(none in config.json)'}; "
        f"supported: {', '.join(supported)}. A new architecture is one file in mappings/ "
        f"(copy mappings/llama.py)."
    )
