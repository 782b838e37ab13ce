"""Where a ``run_with_cache`` call's cache goes, and refusing one that would not fit in memory,
before vLLM runs it.

The estimate comes from the call's plan: for each name the cache will hold (the names read from
vLLM, and the derived names computed from them when the call finishes), the size of one
position's value times the padded positions of every prompt. Attention scores and patterns are
built when read (:mod:`vlens.names.lazy_patterns`), so until then they cost only the q and k they are
rebuilt from, which are counted among the names read; a call that returns a plain dict
(``return_cache_object=False``) builds them all, and they count at ``heads × pos × pos``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PretrainedConfig

from vlens.engine.assembly import POSITION_AXES
from vlens.engine.checkpoint import Checkpoint
from vlens.engine.planning import CallPlan
from vlens.names.compiled import dimension
from vlens.names.derived import BuiltOnRead
from vlens.names.mapping import DerivedSpec, Spec

#: Share of the available memory a cache may take: the rest is for what a call holds besides
#: (rows joined and padded, the engine's own buffers, the output).
HEADROOM = 0.8


class CacheTooLarge(MemoryError):
    """A cache that would not fit in the memory available, refused before the engine ran."""


@dataclass(frozen=True)
class CallSize:
    """The sizes of one call that a cache's size depends on."""

    prompts: int
    positions: int  # the longest request's positions, prompt and generated: the padded length
    samples: int  # tokens each request samples (rows of the sampler's names)
    itemsize: int  # bytes per value

    @classmethod
    def of(
        cls, prompts: Sequence[Sequence[int]], max_new_tokens: int, dtype: torch.dtype
    ) -> CallSize:
        """The last sampled token never goes through the model; at least one token is sampled."""
        longest = max(len(prompt) for prompt in prompts) + max(0, max_new_tokens - 1)
        itemsize = torch.empty((), dtype=dtype).element_size()
        return cls(len(prompts), longest, max(1, max_new_tokens), itemsize)


def held_names(
    specs: dict[str, Spec], wanted: Sequence[str], kept: Sequence[str], build_all: bool
) -> list[str]:
    """The names whose values a call holds once it finishes: those read from vLLM (``kept``) and
    the derived ones computed for ``wanted`` (their derived sources included). Names built on
    read count only when ``build_all`` builds them, and only those ``wanted`` (a pattern is
    built from q and k, never through its scores)."""
    held = dict.fromkeys(kept)
    pending, seen = list(wanted), set()
    while pending:
        name = pending.pop()
        spec = specs[name]
        if name in seen or not isinstance(spec, DerivedSpec):
            continue
        seen.add(name)
        pending.extend(spec.sources)
        if not isinstance(spec.compute, BuiltOnRead) or (build_all and name in wanted):
            held[name] = None
    return list(held)


def value_bytes(spec: Spec, config: PretrainedConfig, size: CallSize) -> int:
    """The bytes of one name's padded ``[batch, ...]`` value."""
    elements = size.prompts
    for label in spec.shape.split():
        if label in POSITION_AXES:
            elements *= size.positions
        elif label == "new_pos":
            elements *= size.samples
        else:
            elements *= axis_size(label, config, spec.shape)
    return elements * size.itemsize


def axis_size(label: str, config: PretrainedConfig, shape: str) -> int:
    """An axis's size from the config; the model width where the config has none (a raw
    location's ``...``)."""
    try:
        return dimension(label, config, shape)
    except NotImplementedError:
        return config.hidden_size


def available_bytes(device: torch.device) -> int | None:
    """Memory free for new values on ``device``; None where vlens cannot tell."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    if device.type != "cpu":
        return None
    try:
        import psutil
    except ImportError:
        return _meminfo_available()
    return psutil.virtual_memory().available


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_cache_fits(
    checkpoint: Checkpoint,
    call: CallPlan,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    device: torch.device,
    build_all: bool,
    dtype: torch.dtype,
) -> None:
    """Refuse (:class:`CacheTooLarge`) a call whose cache (in ``dtype``) would take more than
    :data:`HEADROOM` of the memory available on ``device``, saying how to make it smaller."""
    available = available_bytes(device)
    if available is None:
        return
    size = CallSize.of(prompts, max_new_tokens, dtype)
    specs = checkpoint.hook_specs
    names = held_names(specs, call.wanted, call.kept, build_all)
    sizes = {name: value_bytes(specs[name], checkpoint.hf_config, size) for name in names}
    needed = sum(sizes.values())
    if needed > HEADROOM * available:
        raise CacheTooLarge(refusal(needed, available, device, size, sizes, build_all))


def refusal(
    needed: int,
    available: int,
    device: torch.device,
    size: CallSize,
    sizes: dict[str, int],
    build_all: bool,
) -> str:
    largest = sorted(sizes, key=sizes.__getitem__, reverse=True)[:3]
    shown = ", ".join(f"{name} {_bytes(sizes[name])}" for name in largest)
    patterns = (
        "attention scores and patterns all built for a plain dict (return_cache_object=False)"
        if build_all
        else "attention scores and patterns not counted: they are built when read"
    )
    return (
        f"this call's cache would need about {_bytes(needed)} ({len(sizes)} values over "
        f"{size.prompts} prompt(s) of up to {size.positions} positions; largest: {shown}; "
        f"{patterns}), more than {HEADROOM:.0%} of the {_bytes(available)} available on "
        f"{device}. Make it smaller: read fewer names (names_filter), pass fewer or shorter "
        f"prompts (or fewer max_new_tokens), keep the cache on another device (device=...), or "
        f"write the activations to disk in batches with the activation store (`vlens cache`, "
        f"vlens.store.activations.write_activations)"
    )


def _bytes(count: int) -> str:
    if count >= 2**30:
        return f"{count / 2**30:.1f} GiB"
    return f"{math.ceil(count / 2**20)} MiB"


def check_cache_device(device: Any, tensor_parallel_size: int) -> None:
    """Under tensor parallelism values reach the user's process from another one, on the CPU."""
    if device.type != "cpu" and tensor_parallel_size > 1:
        raise NotImplementedError(
            f"device={str(device)!r}: under tensor parallelism values come back through "
            f"another process, on the CPU; leave device out"
        )
