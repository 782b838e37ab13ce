"""A step's rows as a hook function sees them: TransformerLens's padded batch.

TransformerLens calls a forward hook once per forward with the whole ``[batch, pos, ...]`` value,
padded on the call's padding side. vLLM runs each prompt as a request of its own, in one flat
``[total_tokens, ...]`` batch per engine step. So a hook function shared by a call's prompts
(added hooks, ``fwd_hooks``) runs once per site and engine step on the call's batch: every prompt
of the call on the batch axis, in the call's order, whatever the prompts' lengths; the positions
axis as long as the longest prompt's rows in the step (the whole prompts on a prefill, one row
each on a decode step), each prompt's rows at its start (right padding) or its end (left
padding). Padding holds zeros (vLLM never computes it) and an edit there goes nowhere; a prompt
with no rows in the step (finished, or not yet scheduled) is all padding. ``hook.lengths`` and
``hook.attention_mask`` tell real rows from padding.

A prompt's own hook functions (``prompt_hooks``, steers run as hooks) see its own rows alone,
``[1, pos, ...]``. Either way the value is read from the step once (one span of rows, or its rows
gathered) and, if a function edited it, written back once (:mod:`vlens.runtime.hooks.calls`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

import torch
from torch import Tensor

from vlens.runtime.steps.layout import RequestRows
from vlens.runtime.transfer.messages import PaddingSide, RequestCapture, RequestPlan


def call_of(tag: str) -> str:
    """The call a request belongs to, from its tag ``"{call}:{index}"``."""
    return tag.rpartition(":")[0]


class Member(NamedTuple):
    """A request served at a site in this step: its rows, its plan, where its values go."""

    rows: RequestRows
    plan: RequestPlan
    capture: RequestCapture


@dataclass(eq=False)
class HookBatch:
    """Rows of one step laid out as one hook function's ``[batch, pos, ...]`` value: ``rows[j]``
    (consecutive rows of the step) go to ``places[j]`` on the batch axis of ``size``; their
    prompts are ``requests`` (the call's index of each place). Sites with the same requests share
    it, so that a step with hooks at every layer lays it out once."""

    rows: list[RequestRows]
    places: tuple[int, ...]
    size: int
    requests: tuple[int, ...]
    padding_side: PaddingSide = "right"
    #: the positions axis: the most rows of one prompt
    length: int = field(init=False)
    #: each place's number of real rows (0 for a prompt with none in the step)
    lengths: tuple[int, ...] = field(init=False)
    #: each place's first position (-1 for a prompt with none in the step)
    first_positions: tuple[int, ...] = field(init=False)
    #: the rows as one span of the step (consecutive, in this order), else None
    span: RequestRows | None = field(init=False)
    #: whether the value is the rows themselves, unpadded: every place filled, lengths equal
    dense: bool = field(init=False)
    _index: dict[torch.device, Tensor] = field(init=False, default_factory=dict)
    _slots: dict[torch.device, Tensor] = field(init=False, default_factory=dict)

    @classmethod
    def of_call(cls, members: Sequence[Member]) -> HookBatch:
        """A call's requests in this step (one member each, in the call's order) on the call's
        batch."""
        plan = members[0].plan
        return cls(
            [member.rows for member in members],
            tuple(member.plan.index for member in members),
            plan.call_size,
            tuple(range(plan.call_size)),
            plan.padding_side,
        )

    @classmethod
    def of_request(cls, member: Member) -> HookBatch:
        """One request alone: ``[1, pos, ...]``."""
        return cls([member.rows], (0,), 1, (member.plan.index,))

    def __post_init__(self) -> None:
        counts = [rows.stop - rows.start for rows in self.rows]
        self.length = max(counts)
        lengths, firsts = [0] * self.size, [-1] * self.size
        for place, rows, count in zip(self.places, self.rows, counts):
            lengths[place], firsts[place] = count, rows.first_position
        self.lengths, self.first_positions = tuple(lengths), tuple(firsts)
        self.dense = (
            len(self.rows) == self.size
            and self.places == tuple(range(self.size))
            and all(count == self.length for count in counts)
        )
        first = self.rows[0]
        if len(self.rows) == 1:
            self.span = first
        elif all(a.stop == b.start for a, b in zip(self.rows, self.rows[1:])):
            self.span = RequestRows(first.tag, first.start, self.rows[-1].stop,
                                    first.first_position, 0)
        else:
            self.span = None

    @property
    def request(self) -> int | None:
        """The prompt's index in the call, where the batch is one prompt's; None for a batch."""
        return self.requests[0] if self.size == 1 else None

    @cached_property
    def is_prefill(self) -> bool:
        """Whether some prompt prefills in this step (asked at every site a batch serves)."""
        return any(rows.is_prefill for rows in self.rows)

    @cached_property
    def split_prefill(self) -> tuple[int, RequestRows] | None:
        """A prompt (its index in the call, its rows) whose prefill vLLM split over steps and
        this step runs part of; None where every prefill here is whole."""
        for place, rows in zip(self.places, self.rows):
            count = rows.stop - rows.start
            if rows.is_prefill and (rows.first_position > 0 or count < rows.prompt_length):
                return self.requests[place], rows
        return None

    def index(self, device: torch.device) -> Tensor:
        """The rows of the step, gathered in this order (where they are no span)."""
        if device not in self._index:
            self._index[device] = torch.tensor(
                [i for own in self.rows for i in range(own.start, own.stop)], device=device
            )
        return self._index[device]

    def slots(self, device: torch.device) -> Tensor:
        """Where each gathered row goes in the flattened ``[size * length]`` value."""
        if device not in self._slots:
            slots = []
            for place, rows in zip(self.places, self.rows):
                count = rows.stop - rows.start
                start = place * self.length + (self.length - count) * (self.padding_side == "left")
                slots.extend(range(start, start + count))
            self._slots[device] = torch.tensor(slots, device=device)
        return self._slots[device]

    def padded(self, rows: Tensor) -> Tensor:
        """The gathered ``rows`` (``[rows, ...]``, in this order) as the hook function's own
        ``[size, length, ...]`` tensor, zero at padding (made outside inference mode, so that
        an edit in place bumps its version)."""
        with torch.inference_mode(False):
            if self.dense:
                return rows.clone().unflatten(0, (self.size, self.length))
            value = rows.new_zeros((self.size * self.length, *rows.shape[1:]))
            value[self.slots(rows.device)] = rows
            return value.unflatten(0, (self.size, self.length))

    def unpadded(self, value: Tensor) -> Tensor:
        """The real rows of a ``[size, length, ...]`` value, gathered in this order: what is
        written back (padding goes nowhere)."""
        flat = value.flatten(0, 1)
        return flat if self.dense else flat[self.slots(value.device)]

    def padded_values(
        self, values: Sequence[Tensor], axes: Sequence[int], fill: float
    ) -> Tensor:
        """Per-place values whose ``axes`` are positions (``[head, q_pos, k_pos]`` scores, one
        prompt's each) as one ``[size, ...]`` tensor, padded with ``fill`` on this batch's side:
        the layout of the hook functions of derived names."""
        shape = [max(value.shape[axis] for value in values) if axis in axes else size
                 for axis, size in enumerate(values[0].shape)]
        with torch.inference_mode(False):
            batch = values[0].new_full((self.size, *shape), fill)
            for place, value in zip(self.places, values):
                batch[(place, *self._region(value.shape, shape, axes))] = value
        return batch

    def unpadded_values(
        self, batch: Tensor, like: Sequence[Tensor], axes: Sequence[int]
    ) -> list[Tensor]:
        """The inverse of :meth:`padded_values`: each place's value, shaped as ``like``."""
        shape = list(batch.shape[1:])
        return [batch[(place, *self._region(value.shape, shape, axes))]
                for place, value in zip(self.places, like)]

    def _region(self, own: Sequence[int], whole: Sequence[int], axes: Sequence[int]) -> list[slice]:
        left = self.padding_side == "left"
        return [slice(whole[axis] - size if left else 0, whole[axis] if left else size)
                if axis in axes else slice(None)
                for axis, size in enumerate(own)]
