"""Which requests of an engine step run a hook function together: TransformerLens's batch.

TransformerLens calls a hook function once per forward with the whole batch, ``[batch, pos, ...]``.
vLLM runs each prompt as a request of its own, and its scheduler may put a call's prompts in
different steps (the token budget splits prefills; prompts of different lengths decode at
different positions; some finish early). vlens calls a hook function shared by all prompts of a
call (added hooks, ``fwd_hooks``; :attr:`~vlens.runtime.messages.NamePlan.shared`) once on the
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
from typing import TypeVar

from vlens.runtime.layout import RequestRows
from vlens.runtime.locations import Site
from vlens.runtime.messages import NamePlan, RequestPlan

Member = TypeVar("Member")


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
    members: Sequence[Member],
    key: Callable[[Member], Hashable | None],
    call_size: Callable[[Member], int],
    index: Callable[[Member], int],
    alike: Callable[[Member, Member], bool] | None = None,
) -> list[list[Member]]:
    """``members`` (one per request of this step) as the lists that run together: those of one
    ``key`` form one batch, in ``index`` order, where they are the whole call (``call_size`` of
    them) and ``alike`` the first; every other member alone (and any with the key None)."""
    batches: list[list[Member]] = []
    together: dict[Hashable, list[Member]] = {}
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
