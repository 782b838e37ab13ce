"""Assembling what the workers captured into TransformerLens's ``ActivationCache``.

Values read over whole engine steps arrive already laid out as ``[batch, pos, ...]``, right-padded
with zeros (:class:`~vlens.runtime.step_store.PaddedRows`); values read where hook functions ran
arrive per request as chunks of rows (a whole prefill, pieces of a chunked prefill, one row per
decode step), which are joined in position order and padded here. ``cache.lengths`` and
``cache.attention_mask`` say which positions are real.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, MutableMapping, Sequence
from typing import Any

import torch
from einops import rearrange
from jaxtyping import Bool, Int
from torch import Tensor
from transformer_lens.ActivationCache import ActivationCache
from transformer_lens.utilities import Slice, SliceInput

from vlens.engine.link import Run
from vlens.names.derived import Batch, BuiltOnRead, Value, WeightsOn, with_formed
from vlens.names.lazy_patterns import LazyAttention
from vlens.names.mapping import DerivedSpec, HookSpec, Spec, per_sample
from vlens.names.resolve import UnknownHookName, canonical, short_form
from vlens.runtime.host_blocks import elements_spanned
from vlens.runtime.messages import Chunk, PaddedRows


def assemble(
    model: Any,
    run: Run,
    prompts: list[list[int]],
    generated: bool,
    names: Sequence[str],
    wanted: Sequence[str],
    kept: Sequence[str],
    device: torch.device,
) -> tuple[dict[str, Value], VLensCache]:
    """Every value of ``wanted`` for a finished call, as ``[batch, pos, ...]`` on ``device``
    (``kept`` names, read from vLLM, padded; derived names computed from them, attention scores
    and patterns as values built when read), and the cache of ``names``. With ``generated``,
    positions run on over the sampled tokens (all but the last, which never went through the
    model)."""
    specs: dict[str, Spec] = model.hook_specs
    sampled = run.sampled if generated else [[] for _ in prompts]
    tokens = [p + g[: max(0, len(g) - 1)] for p, g in zip(prompts, sampled)]
    lengths = torch.tensor([len(t) for t in tokens])
    sampled_lengths = torch.tensor([len(s) for s in run.sampled])
    values = {}
    for name in kept:
        spec = specs[name]
        assert isinstance(spec, HookSpec)
        captured = [capture.chunks.get(name, []) for capture in run.captures]
        positions = sampled_lengths if per_sample(spec) else lengths
        value = padded_batch(name, captured, run.whole_steps.get(name), positions.tolist())
        values[name] = value if spec.arrange is None else rearrange(value, spec.arrange)
    batch = Batch(
        mask=(torch.arange(int(lengths.max()))[None] < lengths[:, None]).to(device),
        weights=WeightsOn(model.weights, device),
        sampled=pad_batch([torch.tensor(tokens) for tokens in run.sampled]).to(device),
        lengths=tuple(lengths.tolist()),
    )
    formed = [capture.formed for capture in run.captures]
    for name in wanted:
        _derive(name, specs, values, batch, formed)
    shapes = {name: specs[name].shape for name in names}
    cache = VLensCache(LazyValues({name: values[name] for name in names}), model, lengths, shapes)
    cache.sampled_lengths = sampled_lengths
    cache.tokens = pad_batch([torch.tensor(t) for t in tokens])
    return values, cache


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
    """``value`` on a storage of its own bytes where it views part of a larger one (the graph tier
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


class VLensCache(ActivationCache):
    """TransformerLens's ``ActivationCache`` over a padded batch of vLLM requests.

    Indexing takes canonical names, TransformerLens 4 bridge names and short forms
    (``cache["resid_post", 3]``); a name that is not cached raises an error naming the near ones.
    Attention scores and patterns are built when first read (``cache[name]``, ``.items()``, ...);
    ``to``, ``remove_batch_dim`` and ``apply_slice_to_batch_dim`` leave them unbuilt, and
    :meth:`unpadded` builds one request's alone.
    """

    cache_dict: LazyValues

    def __init__(
        self,
        cache_dict: LazyValues,
        model: Any,
        lengths: Int[Tensor, " batch"],
        shapes: dict[str, str],
        has_batch_dim: bool = True,
    ):
        super().__init__(cache_dict, model, has_batch_dim=has_batch_dim)  # type: ignore[arg-type]
        self.lengths = lengths
        self.shapes = shapes
        self.sampled_lengths = torch.zeros_like(lengths)  # tokens sampled per prompt
        self.tokens: Int[Tensor, "batch pos"] | None = None
        #: ``PATH.inputs`` read as one value: its arguments' cached names, by argument
        self.groups: dict[str, dict[str, str]] = {}

    def unpadded(self, name: str, index: int) -> Tensor:
        """Request ``index``'s value of ``name`` without padding on any position axis."""
        key = self._resolve(name)
        unbuilt = self.cache_dict.unbuilt(key)
        if unbuilt is not None:
            return unbuilt.build_request(index)
        value = self.cache_dict[key][index]
        for axis, word in enumerate(self.shapes[key].split()):
            if word == "new_pos":
                value = value.narrow(axis, 0, int(self.sampled_lengths[index]))
            elif word.endswith("pos"):
                value = value.narrow(axis, 0, int(self.lengths[index]))
        return value

    @property
    def attention_mask(self) -> Bool[Tensor, "batch pos"]:
        """True at real positions, False at padding."""
        positions = torch.arange(int(self.lengths.max()))
        return positions[None, :] < self.lengths[:, None]

    def __getitem__(self, key: Any) -> Tensor:
        if isinstance(key, str) and key in self.groups:  # a call's arguments, by name
            return {argument: self[name] for argument, name in self.groups[key].items()}  # type: ignore[return-value]
        return self.cache_dict[self._resolve(key)]

    def __contains__(self, key: object) -> bool:
        """Whether ``cache[key]`` finds a value, under any spelling ``__getitem__`` takes (without
        building it)."""
        if isinstance(key, str) and key in self.groups:
            return True
        try:
            self._resolve(key)
        except KeyError:
            return False
        return True

    def __repr__(self) -> str:
        return f"VLensCache(batch={len(self.lengths)}, names={len(self.cache_dict)})"

    def _resolve(self, key: Any) -> str:
        """The cached name that ``key`` spells."""
        names = self.cache_dict.keys()
        if isinstance(key, str):
            if key in names:
                return key
            spellings = [key, short_form((key,))]  # "pos_embed" → "hook_pos_embed"
        else:
            spellings = [short_form(_absolute_layer(key, self.model))]
        for name in spellings:
            try:
                return canonical(name, names, "this cache")
            except UnknownHookName:
                continue
        raise UnknownHookName(spellings[0], names, "this cache")

    # ---- TransformerLens's methods that would otherwise build every value --------------------

    def _batch_size(self) -> int:
        return len(self.lengths)

    def to(self, device: str | torch.device) -> VLensCache:
        """Move the cache to ``device`` (values not built yet are built there when read)."""
        self.cache_dict = self.cache_dict.mapped(
            lambda value: value.to(device), lambda lazy: lazy.to(device)
        )
        return self

    def remove_batch_dim(self, batch_size: int | None = None) -> VLensCache:
        if not self.has_batch_dim:
            super().remove_batch_dim(batch_size)  # TransformerLens's warning
            return self
        size = self._batch_size() if batch_size is None else batch_size
        assert size == 1, f"Cannot remove batch dimension from cache with batch size {size}"
        self.cache_dict = self.cache_dict.mapped(
            lambda value: value[0] if value.ndim > 0 and value.size(0) == 1 else value,
            lambda lazy: lazy.select(torch.tensor(0)),
        )
        self.has_batch_dim = False
        return self

    def apply_slice_to_batch_dim(self, batch_slice: Slice | SliceInput) -> VLensCache:
        """The requests ``batch_slice`` picks (an int removes the batch axis), as a new cache."""
        if not isinstance(batch_slice, Slice):
            batch_slice = Slice(batch_slice)
        assert self.has_batch_dim, "Cannot index into a cache without a batch dim"
        size = self._batch_size()
        picked = batch_slice.apply(torch.arange(size), dim=0)

        def sliced(value: Tensor) -> Tensor:
            batched = value.ndim > 0 and value.size(0) == size
            return batch_slice.apply(value, dim=0) if batched else value

        values = self.cache_dict.mapped(sliced, lambda lazy: lazy.select(picked))
        rows = picked.reshape(-1)
        still_batched = batch_slice.mode != "int"
        cache = VLensCache(values, self.model, self.lengths[rows], self.shapes, still_batched)
        cache.sampled_lengths = self.sampled_lengths[rows]
        cache.tokens = None if self.tokens is None else self.tokens[rows]
        cache.groups = self.groups
        return cache


def _absolute_layer(key: tuple, model: Any) -> tuple:
    """TransformerLens lets ``cache["resid_post", -1]`` mean the last layer."""
    if len(key) > 1 and isinstance(key[1], int) and key[1] < 0:
        return (key[0], model.cfg.n_layers + key[1], *key[2:])
    return key
