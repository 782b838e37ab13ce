"""Assembling what the workers captured into TransformerLens's ``ActivationCache``.

Values read over whole engine steps arrive already laid out as ``[batch, pos, ...]``, right-padded
with zeros (:class:`~vlens.runtime.step_store.PaddedRows`); values read where hook functions ran
arrive per request as chunks of rows (a whole prefill, pieces of a chunked prefill, one row per
decode step), which are joined in position order and padded here. ``cache.lengths`` and
``cache.attention_mask`` say which positions are real.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from einops import rearrange
from jaxtyping import Bool, Int
from torch import Tensor
from transformer_lens.ActivationCache import ActivationCache

from vlens.derived import Batch, WeightsOn, with_formed
from vlens.engine import Run
from vlens.mapping import DerivedSpec, HookSpec, Spec, per_sample
from vlens.names import UnknownHookName, canonical, short_form
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
) -> tuple[dict[str, Tensor], VLensCache]:
    """Every value of ``wanted`` for a finished call, as ``[batch, pos, ...]`` on ``device``
    (``kept`` names, read from vLLM, padded; derived names computed from them), and the cache of
    ``names``. With ``generated``, positions run on over the sampled tokens (all but the last,
    which never went through the model)."""
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
    )
    formed = [capture.formed for capture in run.captures]
    for name in wanted:
        _derive(name, specs, values, batch, formed)
    shapes = {name: specs[name].shape for name in names}
    cache = VLensCache({name: values[name] for name in names}, model, lengths, shapes)
    cache.sampled_lengths = sampled_lengths
    cache.tokens = pad_batch([torch.tensor(t) for t in tokens])
    return values, cache


def _derive(
    name: str,
    specs: dict[str, Spec],
    values: dict[str, Tensor],
    batch: Batch,
    formed: Sequence[dict[str, Tensor]],
) -> Tensor:
    """A derived name's value; for the requests whose worker formed it (attention computed
    explicitly for hook functions), the worker's value, as the hooks left it."""
    if name not in values:
        spec = specs[name]
        assert isinstance(spec, DerivedSpec)
        sources = [_derive(source, specs, values, batch, formed) for source in spec.sources]
        values[name] = with_formed(spec.compute(sources, batch), [f.get(name) for f in formed])
    return values[name]


def join_chunks(name: str, chunks: Sequence[Chunk], length: int) -> Tensor:
    """One request's rows of ``name`` for positions ``0:length``, in order, with none missing."""
    ordered = sorted(chunks, key=lambda chunk: chunk.first_position)
    position = 0
    for chunk in ordered:
        if chunk.first_position != position:
            raise RuntimeError(
                f"{name}: positions {position}..{chunk.first_position - 1} were never computed by "
                f"vLLM for this request (was prefix caching turned on?)"
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
        return whole_steps.values
    rows = []
    for index, (chunks, length) in enumerate(zip(captured, lengths)):
        more = whole_steps.chunks(index) if whole_steps is not None else []
        rows.append(join_chunks(name, [*chunks, *more], length))
    return pad_batch(rows)


def pad_batch(values: Sequence[Tensor]) -> Tensor:
    """Stack ``[pos_i, ...]`` tensors into ``[batch, max pos, ...]``, zero-padded on the right."""
    longest = max(value.shape[0] for value in values)
    batch = values[0].new_zeros((len(values), longest, *values[0].shape[1:]))
    for index, value in enumerate(values):
        batch[index, : value.shape[0]] = value
    return batch


class VLensCache(ActivationCache):
    """TransformerLens's ``ActivationCache`` over a padded batch of vLLM requests.

    Indexing takes canonical names, TransformerLens 4 bridge names and short forms
    (``cache["resid_post", 3]``); a name that is not cached raises an error naming the near ones.
    """

    def __init__(
        self,
        cache_dict: dict[str, Tensor],
        model: Any,
        lengths: Int[Tensor, "batch"],
        shapes: dict[str, str],
    ):
        super().__init__(cache_dict, model, has_batch_dim=True)
        self.lengths = lengths
        self.shapes = shapes
        self.sampled_lengths = torch.zeros_like(lengths)  # tokens sampled per prompt
        self.tokens: Int[Tensor, "batch pos"] | None = None

    def unpadded(self, name: str, index: int) -> Tensor:
        """Request ``index``'s value of ``name`` without padding on any position axis."""
        value = self[name][index]
        for axis, word in enumerate(self.shapes[canonical(name, self.shapes)].split()):
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
        names = self.cache_dict.keys()
        if isinstance(key, str):
            if key in names:
                return self.cache_dict[key]
            spellings = [key, short_form((key,))]  # "pos_embed" → "hook_pos_embed"
        else:
            spellings = [short_form(_absolute_layer(key, self.model))]
        for name in spellings:
            try:
                return self.cache_dict[canonical(name, names, "this cache")]
            except UnknownHookName:
                continue
        raise UnknownHookName(spellings[0], names, "this cache")

    def __contains__(self, key: object) -> bool:
        """Whether ``cache[key]`` finds a value, under any spelling ``__getitem__`` takes."""
        try:
            self[key]
        except KeyError:
            return False
        return True

    def __repr__(self) -> str:
        return f"VLensCache(batch={len(self.lengths)}, names={len(self.cache_dict)})"


def _absolute_layer(key: tuple, model: Any) -> tuple:
    """TransformerLens lets ``cache["resid_post", -1]`` mean the last layer."""
    if len(key) > 1 and isinstance(key[1], int) and key[1] < 0:
        return (key[0], model.cfg.n_layers + key[1], *key[2:])
    return key
