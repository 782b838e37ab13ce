"""One request's keys and values of one layer, kept by vlens from the request's first step on, so
that attention computed explicitly at a decode step (or a later prefill chunk) sees every earlier
key without reading vLLM's paged KV cache."""

from __future__ import annotations

from jaxtyping import Float
from torch import Tensor


class KeyValueHistory:
    """Keys ``[pos, kv_heads, d]`` and values ``[pos, kv_heads, d_v]`` by sequence position, in
    buffers that grow by doubling (a decode step appends one row)."""

    def __init__(self) -> None:
        self.keys: Tensor | None = None
        self.values: Tensor | None = None
        self.length = 0

    def extend(
        self,
        first_position: int,
        keys: Float[Tensor, "n kv d"],
        values: Float[Tensor, "n kv d_v"],
    ) -> tuple[Float[Tensor, "k kv d"], Float[Tensor, "k kv d_v"]]:
        """Record this step's rows at positions ``first_position`` on and return every key and
        value up to the last of them. Rows at positions already held replace them and forget
        what came after (vLLM recomputes a preempted request from its start)."""
        if first_position > self.length:
            raise RuntimeError(
                f"positions {self.length}..{first_position - 1} of this request never passed "
                f"through this layer while vlens followed it, so its attention cannot be "
                f"computed explicitly"
            )
        end = first_position + keys.shape[0]
        self._reserve(end, keys, values)
        assert self.keys is not None and self.values is not None
        self.keys[first_position:end] = keys
        self.values[first_position:end] = values
        self.length = end
        return self.keys[:end], self.values[:end]

    def _reserve(self, end: int, keys: Tensor, values: Tensor) -> None:
        capacity = 0 if self.keys is None else self.keys.shape[0]
        if end <= capacity:
            return
        size = max(end, 2 * capacity, 16)
        grown_keys = keys.new_empty((size, *keys.shape[1:]))
        grown_values = values.new_empty((size, *values.shape[1:]))
        if self.keys is not None and self.values is not None:
            grown_keys[: self.length] = self.keys[: self.length]
            grown_values[: self.length] = self.values[: self.length]
        self.keys, self.values = grown_keys, grown_values

