"""Readers: TransformerLens's value of one name, computed from one module call narrowed to one
request's rows (a :class:`vlens.runtime.vocabulary.locations.SiteCall`). They run inside vLLM's worker, in the forward.

Readers are small frozen dataclasses (not lambdas) so that a plan can be pickled to worker
processes. Each returns ``[pos, ...]``; a view into vLLM's buffers is copied by the runtime.

A reader whose value can be edited also has ``write(call, new)``: it changes vLLM's own tensors
(in place, on this request's rows only) so that the model computes on with ``new`` and every
later name sees it. A reader without ``write`` names a value that can be read, not edited.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from einops import rearrange
from jaxtyping import Float
from torch import Tensor, zeros_like

from vlens.runtime.vocabulary.locations import Argument, SiteCall, Split

Reader = Callable[[SiteCall], Tensor]


def writable(reader: Any) -> bool:
    """Whether edits of this reader's value can be written back into the model."""
    if isinstance(reader, (Columns, PerHead, BatchOfOne, HeadsInRows)):
        return writable(reader.source)
    return hasattr(reader, "write")


@dataclass(frozen=True)
class OutputOf:
    """The module's result (or one element of a tuple result), plus another element if given.

    ``OutputOf(0, plus=1)`` reads vLLM's fused-residual pair ``(hidden, residual)`` as their sum.
    """

    element: int | None = None
    plus: int | None = None
    shards: Split | None = None

    def __call__(self, call: SiteCall) -> Tensor:
        value = call.output(self.element, self.shards)
        return value if self.plus is None else value + call.output(self.plus)

    def write(self, call: SiteCall, new: Tensor) -> None:
        """A sum is written as ``(new, 0)``: the next computation adds the two terms, so it reads
        ``new`` exactly (a difference added to the first term would leave rounding residue, which
        a replacement by zeros followed by a norm amplifies)."""
        if self.plus is not None:
            call.assign_output(self.plus, zeros_like(call.output(self.plus)))
        call.assign_output(self.element, new, self.shards)


@dataclass(frozen=True)
class InputOf:
    """An argument of the call, plus another argument if given and not None.

    A decoder layer is called ``layer(positions, hidden, residual)``; the residual stream entering
    it is ``hidden + residual``, or ``hidden`` alone for layer 0, where ``residual`` is None.
    """

    argument: Argument
    plus: Argument | None = None

    def __call__(self, call: SiteCall) -> Tensor:
        first = self.argument
        value = call.argument(first.index, first.name, first.shards)
        if self.plus is not None:
            other = call.argument(self.plus.index, self.plus.name)
            if other is not None:
                value = value + other
        return value

    def write(self, call: SiteCall, new: Tensor) -> None:
        """A sum is written as ``(new, 0)``: the module adds the second argument itself, so it
        reads ``new`` exactly."""
        first = self.argument
        if self.plus is not None:
            other = call.argument(self.plus.index, self.plus.name)
            if other is not None:
                call.assign_argument(self.plus.index, self.plus.name, zeros_like(other))
        call.assign_argument(first.index, first.name, new, first.shards)


@dataclass(frozen=True)
class Columns:
    """Columns ``start:stop`` of the source's last axis: one part of a fused projection."""

    source: Reader
    start: int
    stop: int

    def __call__(self, call: SiteCall) -> Tensor:
        return self.source(call)[..., self.start : self.stop]

    def write(self, call: SiteCall, new: Tensor) -> None:
        whole = self.source(call).clone()
        whole[..., self.start : self.stop] = new
        self.source.write(call, whole)


@dataclass(frozen=True)
class PerHead:
    """``[pos, heads·d_head]`` → ``[pos, heads, d_head]``."""

    source: Reader
    d_head: int

    def __call__(self, call: SiteCall) -> Float[Tensor, "pos head d_head"]:
        return rearrange(self.source(call), "pos (head d) -> pos head d", d=self.d_head)

    def write(self, call: SiteCall, new: Tensor) -> None:
        self.source.write(call, rearrange(new, "pos head d -> pos (head d)"))


@dataclass(frozen=True)
class RepeatPerHead:
    """``[pos, d_model]`` → ``[pos, heads, d_model]``: TransformerLens's per-head input copies."""

    source: Reader
    heads: int

    def __call__(self, call: SiteCall) -> Float[Tensor, "pos head d_model"]:
        x = self.source(call)
        return x[:, None, :].expand(x.shape[0], self.heads, x.shape[1]).clone()


def rms(x: Float[Tensor, "... d"], eps: float) -> Float[Tensor, "... 1"]:
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
    under tensor parallelism, the same vocabulary gather) to every row, with its bias where it
    has one (Phi's).
    """

    source: Reader

    def __call__(self, call: SiteCall) -> Float[Tensor, "pos d_vocab"]:
        return self.logits(call.model, self.source(call))

    def logits(
        self, model: Any, rows: Float[Tensor, "pos d_model"]
    ) -> Float[Tensor, "pos d_vocab"]:
        """The logits of final-norm ``rows`` (also used by the compiled engine, after the step)."""
        head = self.unembedding(model)
        return model.logits_processor(head, rows, getattr(head, "bias", None))

    def unembedding(self, model: Any) -> Any:
        """The module whose weight unembeds: vLLM's ``lm_head``, or the embedding where the model
        has none (its unembedding always tied: Gemma 2, and Gemma in vLLM 0.26)."""
        head = getattr(model, "lm_head", None)
        return head if head is not None else model.model.embed_tokens


def centred(x: Float[Tensor, "... d"]) -> Float[Tensor, "... d"]:
    x = x.float()
    return x - x.mean(-1, keepdim=True)


@dataclass(frozen=True)
class LayerNormScale:
    """``sqrt(var(x) + eps)`` of the residual a LayerNorm reads (the RMS of ``x`` once centred):
    TransformerLens's ``hook_scale``."""

    source: Reader
    eps: float

    def __call__(self, call: SiteCall) -> Float[Tensor, "pos 1"]:
        x = self.source(call)
        return rms(centred(x), self.eps).to(x.dtype)


@dataclass(frozen=True)
class LayerNormNormalized:
    """``(x - mean(x)) / scale``, before the norm's weight and bias: TransformerLens's
    ``hook_normalized``."""

    source: Reader
    eps: float

    def __call__(self, call: SiteCall) -> Float[Tensor, "pos d_model"]:
        x = self.source(call)
        x_centred = centred(x)
        return (x_centred / rms(x_centred, self.eps)).to(x.dtype)


@dataclass(frozen=True)
class Squeezed:
    """The source without its size-1 ``axis`` (MLA's shared key rope part, ``[pos, 1, d]``)."""

    source: Reader
    axis: int

    def __call__(self, call: SiteCall) -> Tensor:
        return self.source(call).squeeze(self.axis)

    def write(self, call: SiteCall, new: Tensor) -> None:
        self.source.write(call, new.unsqueeze(self.axis))


@dataclass(frozen=True)
class BatchOfOne:
    """The source, read at a module that runs on a batch of one: HuggingFace's modules inside
    vLLM's Transformers backend see every step as ``[1, tokens, ...]`` (vLLM's own modules see
    ``[tokens, ...]``). The call's tensors are read without that axis (views: edits still reach
    the model), then narrowed to the request's rows as anywhere else."""

    source: Reader

    def __call__(self, call: SiteCall) -> Tensor:
        return self.source(without_batch_axis(call))

    def write(self, call: SiteCall, new: Tensor) -> None:
        self.source.write(without_batch_axis(call), new)


def without_batch_axis(call: Any) -> Any:
    """``call`` (a dataclass holding the call's ``args``, ``kwargs`` and ``result``) with each
    tensor in them, tuples included, indexed at 0 along its batch axis of one."""
    return dataclasses.replace(
        call,
        args=_first_of_batch(call.args),
        kwargs={key: _first_of_batch(value) for key, value in call.kwargs.items()},
        result=_first_of_batch(call.result),
    )


def _first_of_batch(value: Any) -> Any:
    if isinstance(value, tuple):
        return tuple(_first_of_batch(item) for item in value)
    if isinstance(value, Tensor) and value.dim() > 1:
        if value.shape[0] != 1:
            raise ValueError(
                f"a module of a batch of one was called with a {tuple(value.shape)} tensor: its "
                f"first axis is not a batch of one, so the mapping names the wrong module"
            )
        return value[0]
    return value


@dataclass(frozen=True)
class HeadsInRows:
    """The source, read at a per-head module (a q/k norm) that some vLLMs call on
    ``[tokens·heads, d_head]`` rows (vLLM 0.26's Apertus) where others call it on
    ``[tokens, heads, d_head]``: a result of the first kind is viewed as the second (a view:
    edits still reach the model) before it is narrowed to the request's rows, which are
    tokens. ``heads``: the model's, of which each tensor-parallel rank computes its share."""

    source: Reader
    heads: int

    def __call__(self, call: SiteCall) -> Tensor:
        return self.source(self._per_token(call))

    def write(self, call: SiteCall, new: Tensor) -> None:
        self.source.write(self._per_token(call), new)

    def _per_token(self, call: Any) -> Any:
        result = call.result
        if not isinstance(result, Tensor) or result.dim() != 2:
            return call
        ranks = 1 if call.parallel is None else call.parallel.size
        return dataclasses.replace(
            call, result=result.view(-1, self.heads // ranks, result.shape[-1])
        )
