"""TransformerLens's ``ActivationCache`` over a padded batch of vLLM requests: a vlens cache *is*
one, so ``accumulated_resid``, ``logit_attrs``... are TransformerLens's own code; what it reads
from the model comes from the ``HookedVLLM`` (:mod:`vlens.hooked.weight_views`)."""

from __future__ import annotations

from typing import Any

import torch
from jaxtyping import Bool, Int
from torch import Tensor
from transformer_lens.ActivationCache import ActivationCache

from vlens.engine.assembly import Assembled, LazyValues, padding_mask
from vlens.names.resolve import UnknownHookName, canonical, short_form
from vlens.names.tl_versions import Slice, SliceInput
from vlens.runtime.transfer.messages import PaddingSide


class VLensCache(ActivationCache):
    """TransformerLens's ``ActivationCache`` over a padded batch of vLLM requests.

    Indexing takes canonical names, TransformerLens 4 bridge names and short forms
    (``cache["resid_post", 3]``); a name that is not cached raises an error naming the near ones.
    Attention scores and patterns are built when first read (``cache[name]``, ``.items()``, ...);
    ``to``, ``remove_batch_dim`` and ``apply_slice_to_batch_dim`` leave them unbuilt, and
    :meth:`unpadded` builds one request's alone.
    """

    cache_dict: LazyValues

    @classmethod
    def of(cls, assembled: Assembled, model: Any) -> VLensCache:
        """The cache of a finished call's ``assembled`` values; ``model`` is what TransformerLens's
        analysis methods read the model from (``cfg``, weights, tokenizer): the ``HookedVLLM``."""
        cache = cls(assembled.cached, model, assembled.lengths, assembled.shapes)
        cache.sampled_lengths = assembled.sampled_lengths
        cache.tokens = assembled.tokens
        cache.padding_side = assembled.padding_side
        return cache

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
        #: where each request's padding is: after its positions, or before them
        self.padding_side: PaddingSide = "right"

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
                length = int(self.lengths[index])
                start = value.shape[axis] - length if self.padding_side == "left" else 0
                value = value.narrow(axis, start, length)
        return value

    @property
    def attention_mask(self) -> Bool[Tensor, "batch pos"]:
        """True at real positions, False at padding."""
        positions = None if self.tokens is None else self.tokens.shape[1]
        return padding_mask(self.lengths, self.padding_side, positions)

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
        cache.padding_side = self.padding_side
        return cache


def _absolute_layer(key: tuple, model: Any) -> tuple:
    """TransformerLens lets ``cache["resid_post", -1]`` mean the last layer."""
    if len(key) > 1 and isinstance(key[1], int) and key[1] < 0:
        return (key[0], model.cfg.n_layers + key[1], *key[2:])
    return key
