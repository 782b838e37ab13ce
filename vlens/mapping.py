"""The vocabulary that mapping files are written in.

A mapping file (``mappings/<arch>.py``) says, for each TransformerLens hook name, *where* its value
lives in vLLM's module tree (a :class:`Site`) and *how* to turn what that module sees into
TransformerLens's value (a reader). The runtime fires the site, narrows everything to one
request's rows, and calls the reader; it knows nothing about architectures. Readers and writers
are small frozen dataclasses (not lambdas) so that a plan can be pickled to worker processes.

Names and paths may contain ``{layer}``; :func:`expand_layers` turns them into one entry per layer.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Literal, Protocol

import torch
from jaxtyping import Float
from torch import Tensor

Event = Literal["input", "output"]


@dataclass(frozen=True)
class Site:
    """A place in vLLM's module tree: the call's arguments (``input``) or its result (``output``)."""

    path: str
    event: Event

    def for_layer(self, layer: int) -> Site:
        return dataclasses.replace(self, path=self.path.format(layer=layer))


class SiteCall(Protocol):
    """What a reader sees: one module call, narrowed to the rows of one request.

    Every accessor returns a view into vLLM's own tensors, so an in-place change reaches the model.
    """

    @property
    def model(self) -> torch.nn.Module: ...

    def argument(self, index: int, name: str) -> Any: ...

    def output(self, element: int | None) -> Any: ...


Reader = Callable[[SiteCall], Tensor]


@dataclass(frozen=True)
class Argument:
    """An argument of the call, found by keyword or else by position."""

    index: int
    name: str


# --------------------------------------------------------------------------------------------
# Readers: the value of one name, computed from one narrowed call.
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OutputOf:
    """The module's result (or one element of a tuple result), plus another element if given.

    ``OutputOf(0, plus=1)`` reads vLLM's fused-residual pair ``(hidden, residual)`` as their sum.
    """

    element: int | None = None
    plus: int | None = None

    def __call__(self, call: SiteCall) -> Tensor:
        value = call.output(self.element)
        return value if self.plus is None else value + call.output(self.plus)


@dataclass(frozen=True)
class InputOf:
    """An argument of the call, plus another argument if given and not None.

    A decoder layer is called ``layer(positions, hidden, residual)``; the residual stream entering
    it is ``hidden + residual``, or ``hidden`` alone for layer 0, where ``residual`` is None.
    """

    argument: Argument
    plus: Argument | None = None

    def __call__(self, call: SiteCall) -> Tensor:
        value = call.argument(self.argument.index, self.argument.name)
        if self.plus is not None:
            other = call.argument(self.plus.index, self.plus.name)
            if other is not None:
                value = value + other
        return value


def rms(x: Float[Tensor, "pos d"], eps: float) -> Float[Tensor, "pos 1"]:
    return (x.float().pow(2).mean(-1, keepdim=True) + eps).sqrt()


@dataclass(frozen=True)
class RmsScale:
    """``sqrt(mean(x²) + eps)`` of the residual an RMSNorm reads: TransformerLens's ``hook_scale``."""

    source: Reader
    eps: float

    def __call__(self, call: SiteCall) -> Float[Tensor, "pos 1"]:
        x = self.source(call)
        return rms(x, self.eps).to(x.dtype)


@dataclass(frozen=True)
class RmsNormalized:
    """``x / scale``, before the norm's weight: TransformerLens's ``hook_normalized``."""

    source: Reader
    eps: float

    def __call__(self, call: SiteCall) -> Float[Tensor, "pos d_model"]:
        x = self.source(call)
        return (x.float() / rms(x, self.eps)).to(x.dtype)


@dataclass(frozen=True)
class LogitsOf:
    """Logits at every row, from the final norm's output, through the model's own logits processor.

    vLLM computes logits for the sampled positions only; this applies the same ``lm_head`` (and,
    under tensor parallelism, the same vocabulary gather) to every row.
    """

    source: Reader

    def __call__(self, call: SiteCall) -> Float[Tensor, "pos d_vocab"]:
        model = call.model
        return model.logits_processor(model.lm_head, self.source(call))


# --------------------------------------------------------------------------------------------
# Hook specs: a name's site, reader and documented shape. Mapping files build them with the
# helpers below so that they read like the forward pass they describe.
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HookSpec:
    """How one canonical TransformerLens name is read from vLLM.

    ``shape`` is the value's shape for one request, in jaxtyping words, without the batch axis.
    """

    site: Site
    read: Reader
    shape: str
    doc: str = ""

    def for_layer(self, layer: int) -> HookSpec:
        return dataclasses.replace(self, site=self.site.for_layer(layer))


def leaving(
    path: str, element: int | None = None, plus: int | None = None, shape: str = "pos d_model"
) -> HookSpec:
    """The value a module returns (``element`` of a tuple; ``plus`` another element added)."""
    return HookSpec(Site(path, "output"), OutputOf(element, plus), shape)


def entering(
    path: str, argument: Argument, plus: Argument | None = None, shape: str = "pos d_model"
) -> HookSpec:
    """The value a module is called with (``plus`` another argument added when not None)."""
    return HookSpec(Site(path, "input"), InputOf(argument, plus), shape)


def rms_scale(of: HookSpec, eps: float) -> HookSpec:
    return HookSpec(of.site, RmsScale(of.read, eps), "pos 1")


def rms_normalized(of: HookSpec, eps: float) -> HookSpec:
    return HookSpec(of.site, RmsNormalized(of.read, eps), of.shape)


def logits(of: HookSpec) -> HookSpec:
    return HookSpec(of.site, LogitsOf(of.read), "pos d_vocab")


# --------------------------------------------------------------------------------------------
# One architecture's mapping.
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ArchitectureMapping:
    """The names of one architecture: ``hook_specs(config)`` returns them with ``{layer}`` templates.

    ``architectures`` are the HuggingFace class names (``config.architectures``) it serves.
    """

    architectures: tuple[str, ...]
    hook_specs: Callable[[Any], dict[str, HookSpec]]

    def expanded(self, config: Any) -> dict[str, HookSpec]:
        return expand_layers(self.hook_specs(config), config.num_hidden_layers)


def expand_layers(specs: dict[str, HookSpec], n_layers: int) -> dict[str, HookSpec]:
    """One entry per layer for every name that contains ``{layer}``, in forward order."""
    expanded: dict[str, HookSpec] = {}
    global_before = {n: s for n, s in specs.items() if "{layer}" not in n and not _after_blocks(n)}
    global_after = {n: s for n, s in specs.items() if "{layer}" not in n and _after_blocks(n)}
    expanded.update(global_before)
    for layer in range(n_layers):
        for name, spec in specs.items():
            if "{layer}" in name:
                expanded[name.format(layer=layer)] = spec.for_layer(layer)
    expanded.update(global_after)
    return expanded


def _after_blocks(name: str) -> bool:
    return name.startswith(("ln_final.", "unembed."))
