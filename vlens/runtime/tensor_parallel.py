"""Whole values from tensor-parallel shards, and shards from whole values.

Under tensor parallelism each rank holds a slice of the column-parallel projections' outputs
(``qkv_proj``, ``gate_up_proj``), of per-head attention values and of the MLP's hidden
activations. A mapping marks such a value with :class:`~vlens.runtime.vocabulary.locations.Shards`; the runtime
gathers it so that every rank's readers and hooks see the whole value, exactly as with one rank,
and writes an edit back as each rank's own slice. A value each rank holds a partial sum of
(:class:`~vlens.runtime.vocabulary.locations.PartialSums`) is summed over the ranks, and an edit's difference goes to
rank 0's part. Every rank runs the same plans on the same layout, so the collectives line up.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from vlens.runtime.vocabulary.locations import PartialSums, Shards, Split


@dataclass(frozen=True)
class TensorParallel:
    """This worker's place in the tensor-parallel group."""

    rank: int
    size: int

    @classmethod
    def of_this_worker(cls) -> TensorParallel:
        from vllm.distributed import (
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        return cls(get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size())

    def local_widths(self, shards: Shards, local: Tensor) -> list[int]:
        split = [index not in shards.replicated for index in range(len(shards.parts))]
        widths = [part // self.size if cut else part for part, cut in zip(shards.parts, split)]
        uneven = any(part % self.size for part, cut in zip(shards.parts, split) if cut)
        if uneven or sum(widths) != local.shape[shards.dim]:
            raise NotImplementedError(
                f"a value of parts {shards.parts} is not split evenly over {self.size} ranks "
                f"(e.g. fewer key/value heads than ranks, which vLLM replicates): vlens cannot "
                f"give it whole under this tensor-parallel size"
            )
        return widths

    def whole(self, local: Tensor, split: Split) -> Tensor:
        """The whole value of which ``local`` is this rank's part (a collective)."""
        if isinstance(split, PartialSums):
            from vllm.distributed import tensor_model_parallel_all_reduce

            return tensor_model_parallel_all_reduce(local.clone())
        return self.gather(local, split)

    def own_part(self, whole: Tensor, split: Split, local: Tensor) -> Tensor:
        """This rank's part of an edited ``whole`` value (the inverse of :meth:`whole`; for
        partial sums a collective: rank 0's part takes the edit, the others stay)."""
        if isinstance(split, PartialSums):
            before = self.whole(local, split)
            return local + (whole - before) if self.rank == 0 else local
        return self.own_slice(whole, split, local)

    def gather(self, local: Tensor, shards: Shards) -> Tensor:
        """Every rank's slice joined into the whole value, parts in their original order (a
        replicated part as rank 0 holds it). The value is gathered along its last dimension, the
        split one flattened with those after it (``[pos, heads, d_head]`` as
        ``[pos, heads * d_head]``): the one form of vLLM's all-gather that every split value then
        takes."""
        from vllm.distributed import tensor_model_parallel_all_gather

        widths = self.local_widths(shards, local)
        dim = shards.dim % local.dim()
        trailing = tuple(local.shape[dim + 1 :])
        inner = math.prod(trailing)
        joined = tensor_model_parallel_all_gather(local.contiguous().flatten(dim), dim=dim)
        per_rank = [
            chunk.split([width * inner for width in widths], dim=dim)
            for chunk in joined.chunk(self.size, dim=dim)
        ]
        whole = torch.cat([
            piece
            for p in range(len(widths))
            for piece in ([per_rank[0][p]] if p in shards.replicated else [r[p] for r in per_rank])
        ], dim)
        return whole.unflatten(dim, (-1, *trailing))

    def own_slice(self, whole: Tensor, shards: Shards, local: Tensor) -> Tensor:
        """This rank's slice of a whole value (the inverse of :meth:`gather`)."""
        self.local_widths(shards, local)  # refuses a value not split as ``shards`` says
        dim = shards.dim % whole.dim()
        parts = whole.split(list(shards.parts), dim=dim)
        return torch.cat([
            part if p in shards.replicated else part.chunk(self.size, dim=dim)[self.rank]
            for p, part in enumerate(parts)
        ], dim)
