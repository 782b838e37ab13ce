"""Assembling what the workers captured into ``[batch, pos, ...]`` values, the stuff of
TransformerLens's ``ActivationCache`` (:mod:`vlens.hooked.cache`) and of served captures.

Values read over whole engine steps arrive already laid out as ``[batch, pos, ...]``,
right-padded with zeros (:class:`~vlens.runtime.transfer.messages.PaddedRows`); values read where
hook functions ran arrive per request as chunks of rows (a whole prefill, pieces of a chunked
prefill, one row per decode step), which are joined in position order and padded here.
``lengths`` and ``attention_mask`` say which positions are real.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, MutableMapping, Sequence
from dataclasses import dataclass

import torch
from einops import rearrange
from jaxtyping import Bool, Int
from torch import Tensor

from vlens.engine.checkpoint import Checkpoint
from vlens.engine.engine import Run
from vlens.engine.planning import CallPlan
from vlens.names.derived import Batch, BuiltOnRead, Value, WeightsOn, with_formed
from vlens.names.lazy_patterns import LazyAttention
from vlens.names.mapping import DerivedSpec, HookSpec, Spec, per_sample
from vlens.runtime.transfer.host_blocks import elements_spanned
from vlens.runtime.transfer.messages import Chunk, PaddedRows, PaddingSide

#: The axes of a name's shape that run over a request's positions, and pad.
POSITION_AXES = ("pos", "query_pos", "key_pos")


@dataclass
class Assembled:
    """A finished call's values as ``[batch, pos, ...]``: every name it computed (``values``:
    its cache's names, its output's, and what derived names were built from), the cache's names
    among them (``cached``, with their shapes), and each request's positions."""

    values: dict[str, Value]
    cached: LazyValues
    shapes: dict[str, str]
    lengths: Int[Tensor, " batch"]  # positions run through the model, per request
    sampled_lengths: Int[Tensor, " batch"]  # tokens sampled, per request
    tokens: Int[Tensor, "batch pos"]  # the token at every position, zero at padding
    padding_side: PaddingSide = "right"

    @property
    def attention_mask(self) -> Bool[Tensor, "batch pos"]:
        """True at real positions, False at padding."""
        return padding_mask(self.lengths, self.padding_side, self.tokens.shape[1])


def assemble(
    checkpoint: Checkpoint,
    call: CallPlan,
    run: Run,
    prompts: list[list[int]],
    generated: bool,
    device: torch.device,
) -> Assembled:
    """Every value of ``call.wanted`` for a finished call, as ``[batch, pos, ...]`` on ``device``
    (``call.kept`` names, read from vLLM, padded; derived names computed from them, attention
    scores and patterns as values built when read). With ``generated``, positions run on over
    the sampled tokens (all but the last, which never went through the model)."""
    specs = checkpoint.hook_specs
    sampled = run.sampled if generated else [[] for _ in prompts]
    tokens = [p + g[: max(0, len(g) - 1)] for p, g in zip(prompts, sampled)]
    lengths = torch.tensor([len(t) for t in tokens])
    sampled_lengths = torch.tensor([len(s) for s in run.sampled])
    values = {}
    for name in call.kept:
        spec = specs[name]
        assert isinstance(spec, HookSpec)
        captured = [capture.chunks.get(name, []) for capture in run.captures]
        positions = sampled_lengths if per_sample(spec) else lengths
        value = padded_batch(name, captured, run.whole_steps.get(name), positions.tolist())
        values[name] = value if spec.arrange is None else rearrange(value, spec.arrange)
    batch = Batch(
        mask=padding_mask(lengths).to(device),
        weights=WeightsOn(checkpoint.weights, device),
        sampled=pad_batch([torch.tensor(tokens) for tokens in run.sampled]).to(device),
        lengths=tuple(lengths.tolist()),
    )
    formed = [capture.formed for capture in run.captures]
    for name in call.wanted:
        _derive(name, specs, values, batch, formed)
    tokens_batch = pad_batch([torch.tensor(t) for t in tokens])
    side = call.padding_side
    if side == "left":  # every value was assembled right-padded
        for name in call.wanted:
            values[name] = padded_left(values[name], specs[name].shape, lengths)
        tokens_batch = padded_left(tokens_batch, "pos", lengths)
    cached = LazyValues({name: values[name] for name in call.names})
    shapes = {name: specs[name].shape for name in call.names}
    return Assembled(values, cached, shapes, lengths, sampled_lengths, tokens_batch, side)


def padded_left(value: Value, shape: str, lengths: Int[Tensor, " batch"]) -> Value:
    """A right-padded ``[batch, ...]`` value of ``shape`` padded on the left instead: each
    request's positions moved to the end of every position axis (``pos``, ``query_pos``,
    ``key_pos``; a sampler name's ``new_pos`` stays as it is)."""
    if isinstance(value, LazyAttention):
        return value.padded_on("left")
    axes = [axis + 1 for axis, label in enumerate(shape.split()) if label in POSITION_AXES]
    if not axes:
        return value
    positions = value.shape[axes[0]]
    moved = value.clone()
    for index, length in enumerate(lengths.tolist()):
        if length < positions:
            moved[index] = value[index].roll([positions - length] * len(axes),
                                             [axis - 1 for axis in axes])
    return moved


def padding_mask(
    lengths: Int[Tensor, " batch"], side: PaddingSide = "right", positions: int | None = None
) -> Bool[Tensor, "batch pos"]:
    """True at request ``i``'s ``lengths[i]`` real positions (the first ones, or with left
    padding the last ones) of ``positions`` (the longest request's, unless given), False at its
    padding."""
    positions = int(lengths.max()) if positions is None else positions
    offsets = torch.arange(positions)[None, :]
    if side == "left":
        return offsets >= positions - lengths[:, None]
    return offsets < lengths[:, None]


def _derive(
    name: str,
    specs: dict[str, Spec],
    values: dict[str, Value],
    batch: Batch,
    formed: Sequence[dict[str, Tensor]],
) -> Value:
    """A derived name's value; for the requests whose worker formed it (attention computed
    explicitly for hook functions), the worker's value, as the hooks left it."""
    if name not in values:
        spec = specs[name]
        assert isinstance(spec, DerivedSpec)
        sources = [_derive(source, specs, values, batch, formed) for source in spec.sources]
        if not isinstance(spec.compute, BuiltOnRead):
            sources = [built(source) for source in sources]
        values[name] = with_formed(spec.compute(sources, batch), [f.get(name) for f in formed])
    return values[name]


def built(value: Value) -> Tensor:
    """The tensor of a value, building it if it is built on read."""
    return value.build() if isinstance(value, LazyAttention) else value


def join_chunks(name: str, chunks: Sequence[Chunk], length: int) -> Tensor:
    """One request's rows of ``name`` for positions ``0:length``, in order, with none missing.

    Rows past ``length`` are left out: with asynchronous scheduling (vLLM's default on CUDA)
    vLLM runs the forward of a request's last sampled token before it learns that the request
    has finished, and that position is not part of the request (TransformerLens's cache ends
    at the last token fed to the model)."""
    ordered = [
        Chunk(chunk.first_position, chunk.value[: length - chunk.first_position])
        for chunk in sorted(chunks, key=lambda chunk: chunk.first_position)
        if chunk.first_position < length
    ]
    if not ordered and ".source." in name:
        raise RuntimeError(
            f"{name}: this operation never ran for this request: the forward listed by "
            f"model.source() holds it in a branch this layer does not take (a layer without "
            f"rotary embedding, for instance); read it at a layer that runs it"
        )
    position = 0
    for chunk in ordered:
        if chunk.first_position < position:
            raise RuntimeError(
                f"{name}: position {chunk.first_position} of this request was captured twice"
            )
        if chunk.first_position > position:
            raise RuntimeError(
                f"{name}: positions {position}..{chunk.first_position - 1} were never computed by "
                f"vLLM for this request, so they have no value"
            )
        position += chunk.value.shape[0]
    if position != length:
        raise RuntimeError(f"{name}: captured {position} positions, expected {length}")
    return ordered[0].value if len(ordered) == 1 else torch.cat([chunk.value for chunk in ordered])


def padded_batch(
    name: str,
    captured: Sequence[Sequence[Chunk]],
    whole_steps: PaddedRows | None,
    lengths: Sequence[int],
) -> Tensor:
    """``[batch, pos, ...]`` values of ``name`` for requests of these ``lengths``: request ``i``'s
    chunks (``captured[i]``, where hook functions ran) and whole-step reads joined and padded;
    the whole-step reads' own tensor, uncopied, when they alone hold every position."""
    if whole_steps is not None and not any(captured) and whole_steps.is_batch(lengths):
        return with_own_storage(whole_steps.values)
    rows = []
    for index, (chunks, length) in enumerate(zip(captured, lengths)):
        more = whole_steps.chunks(index) if whole_steps is not None else []
        rows.append(join_chunks(name, [*chunks, *more], length))
    return pad_batch(rows)


def with_own_storage(value: Tensor) -> Tensor:
    """``value`` on a storage of its own bytes where it views part of a larger one (the compiled engine
    writes names of one shape into one host allocation), without a copy: ``torch.save`` of one
    name then writes that name, as with TransformerLens's cache, not its whole allocation. The
    new storage holds the old one alive."""
    if value.device.type != "cpu" or value.numel() == 0 or min(value.stride(), default=0) < 0:
        return value
    item = value.element_size()
    extent = elements_spanned(tuple(value.shape), value.stride())
    storage = value.untyped_storage()
    if storage.nbytes() <= extent * item:
        return value
    start = value.storage_offset() * item
    with torch.inference_mode(False):
        every_byte = torch.empty(0, dtype=torch.uint8).set_(storage)
        region = every_byte[start : start + extent * item].numpy()  # holds ``storage``
        return torch.frombuffer(region, dtype=value.dtype).as_strided(value.shape, value.stride())


def pad_batch(values: Sequence[Tensor]) -> Tensor:
    """Stack ``[pos_i, ...]`` tensors into ``[batch, max pos, ...]``, zero-padded on the right."""
    longest = max(value.shape[0] for value in values)
    batch = values[0].new_zeros((len(values), longest, *values[0].shape[1:]))
    for index, value in enumerate(values):
        batch[index, : value.shape[0]] = value
    return batch


class LazyValues(MutableMapping[str, Tensor]):
    """A cache's values by name, where some (attention scores and patterns) are built the first
    time they are read and kept from then on. Membership, length and iteration over names
    build nothing."""

    def __init__(self, values: dict[str, Value]) -> None:
        self._values = values

    def __getitem__(self, name: str) -> Tensor:
        value = self._values[name]
        if isinstance(value, LazyAttention):
            value = self._values[name] = value.build()
        return value

    def __setitem__(self, name: str, value: Tensor) -> None:
        self._values[name] = value

    def __delitem__(self, name: str) -> None:
        del self._values[name]

    def __contains__(self, name: object) -> bool:
        return name in self._values

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        waiting = sum(isinstance(value, LazyAttention) for value in self._values.values())
        return f"LazyValues({len(self._values)} names, {waiting} not built yet)"

    def unbuilt(self, name: str) -> LazyAttention | None:
        """``name``'s value if it is still to be built, else None."""
        value = self._values[name]
        return value if isinstance(value, LazyAttention) else None

    def mapped(
        self, tensor: Callable[[Tensor], Tensor], lazy: Callable[[LazyAttention], LazyAttention]
    ) -> LazyValues:
        """Every value transformed, built ones by ``tensor``, the others by ``lazy`` (so that they
        stay unbuilt)."""
        return LazyValues(
            {
                name: lazy(value) if isinstance(value, LazyAttention) else tensor(value)
                for name, value in self._values.items()
            }
        )
