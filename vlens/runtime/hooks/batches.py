"""Which requests of an engine step run a hook function together: TransformerLens's batch.

TransformerLens calls a hook function once per forward with the whole batch, ``[batch, pos, ...]``.
vLLM runs each prompt as a request of its own, and its scheduler may put a call's prompts in
different steps (the token budget splits prefills; prompts of different lengths decode at
different positions; some finish early). vlens calls a hook function shared by all prompts of a
call (added hooks, ``fwd_hooks``; :attr:`~vlens.runtime.transfer.messages.NamePlan.shared`) once on the
call's batch, in the prompts' order in the call, wherever that batch is whole in a step: every
prompt of the call present, with the same number of rows (and all prefilling, or all decoding),
and the same names and hook functions at the site. Row-wise values (the residual stream, MLP and
attention outputs, ...) batch even where the prompts sit at different positions, as prompts of
different lengths do when they decode together (:func:`shape_key`; ``hook.first_positions``
says where each one is); attention scores and patterns, whose shapes depend on the position,
batch only where every prompt is at the same one (:func:`rows_key`). Everywhere else each
request's hook functions run on its own value, ``[1, pos, ...]``, as they always may
(``prompt_hooks`` and steers are per prompt by design). The batch is always the whole call, so
that ``x[i]`` is prompt ``i``, as in TransformerLens.

Whether a call's requests agree at a site is decided once, when the call's plans arrive
(:func:`batched_sites`); each step only groups by rows (:func:`in_batches`). Every tensor-parallel
rank receives the same plans and reads the same layout, so every rank groups alike.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, TypeVar

import torch
from torch import Tensor

from vlens.runtime.steps.layout import RequestRows
from vlens.runtime.transfer.messages import NamePlan, RequestCapture, RequestPlan
from vlens.runtime.vocabulary.locations import Site

Item = TypeVar("Item")


def call_of(tag: str) -> str:
    """The call a request belongs to, from its tag ``"{call}:{index}"``."""
    return tag.rpartition(":")[0]


def shares_hooks(names: Sequence[NamePlan]) -> bool:
    """Whether some of a site's names carry hook functions, and all of those are shared by the
    call's prompts."""
    hooked = [name for name in names if name.hooks]
    return bool(hooked) and all(name.shared for name in hooked)


def batched_sites(requests: Mapping[str, RequestPlan]) -> set[tuple[str, Site]]:
    """The ``(call, site)`` pairs at which a call's requests (all among ``requests``, by tag)
    may run their hook functions as one batch: two or more of them, each with the same names at
    the site, their hook functions all shared."""
    by_call: dict[str, list[RequestPlan]] = {}
    for tag, plan in requests.items():
        by_call.setdefault(call_of(tag), []).append(plan)
    found = set()
    for call, plans in by_call.items():
        if len(plans) < 2 or len(plans) != plans[0].call_size:
            continue
        for site, names in plans[0].sites.items():
            if shares_hooks(names) and all(plan.sites.get(site) == names for plan in plans[1:]):
                found.add((call, site))
    return found


def rows_key(rows: RequestRows) -> tuple[str, int, int]:
    """What a batch's requests share in a step where values depend on the position (attention
    scores and patterns): their call, first position and number of rows."""
    return call_of(rows.tag), rows.first_position, rows.stop - rows.start


def shape_key(rows: RequestRows) -> tuple[str, int, bool]:
    """What a batch's requests share in a step for a row-wise value: their call, number of
    rows, and whether they prefill."""
    return call_of(rows.tag), rows.stop - rows.start, rows.is_prefill


def in_batches(
    members: Sequence[Item],
    key: Callable[[Item], Hashable | None],
    call_size: Callable[[Item], int],
    index: Callable[[Item], int],
    alike: Callable[[Item, Item], bool] | None = None,
) -> list[list[Item]]:
    """``members`` (one per request of this step) as the lists that run together: those of one
    ``key`` form one batch, in ``index`` order, where they are the whole call (``call_size`` of
    them) and ``alike`` the first; every other member alone (and any with the key None)."""
    batches: list[list[Item]] = []
    together: dict[Hashable, list[Item]] = {}
    for member in members:
        found = key(member)
        if found is None:
            batches.append([member])
        else:
            together.setdefault(found, []).append(member)
    for group in together.values():
        whole = len(group) > 1 and len(group) == call_size(group[0])
        if whole and (alike is None or all(alike(group[0], other) for other in group[1:])):
            batches.append(sorted(group, key=index))
        else:
            batches.extend([member] for member in group)
    return batches


class Member(NamedTuple):
    """A request served at a site in this step: its rows, its plan, where its values go."""

    rows: RequestRows
    plan: RequestPlan
    capture: RequestCapture


@dataclass
class StepBatch:
    """Requests of one step that run a site's hook functions together (one, or a call's whole
    batch), in their order in the call, and where their rows are. Sites with the same requests
    share it, so that a step with hooks at every layer works this out once, not per layer."""

    rows: list[RequestRows]
    indices: tuple[int, ...]  # in the call
    members: list[Member] = field(default_factory=list)
    first_positions: tuple[int, ...] = field(init=False)
    #: the members' rows as one span of the step (consecutive, in this order), else None
    span: RequestRows | None = field(init=False)
    #: whether some member prefills in this step
    prefills: bool = field(init=False)
    _index: dict[torch.device, Tensor] = field(init=False, default_factory=dict)

    @classmethod
    def of(cls, members: list[Member]) -> StepBatch:
        rows = [member.rows for member in members]
        return cls(rows, tuple(member.plan.index for member in members), members)

    def __post_init__(self) -> None:
        self.first_positions = tuple(rows.first_position for rows in self.rows)
        self.prefills = any(rows.is_prefill for rows in self.rows)
        first = self.rows[0]
        if len(self.rows) == 1:
            self.span = first
        elif all(a.stop == b.start for a, b in zip(self.rows, self.rows[1:])):
            self.span = RequestRows(first.tag, first.start, self.rows[-1].stop,
                                    first.first_position, 0)
        else:
            self.span = None

    @property
    def length(self) -> int:
        """Each member's number of rows (one for all)."""
        return self.rows[0].stop - self.rows[0].start

    def index(self, device: torch.device) -> Tensor:
        """The members' rows of the step, gathered in batch order (where they are no span)."""
        if device not in self._index:
            self._index[device] = torch.tensor(
                [i for own in self.rows for i in range(own.start, own.stop)], device=device
            )
        return self._index[device]
