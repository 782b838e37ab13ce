"""Everything that crosses between the user's process and vLLM's workers (under tensor parallelism,
a process boundary): what a request asks for (its plan, recognised by the tag in its sampling
parameters), what the workers hand back when requests finish (captured rows, errors), and what a
watched generation recorded about the module tree.

Plans carry the mapping's readers (frozen dataclasses), :class:`~vlens.runtime.vocabulary.steering.Steer` values and
the user's hook functions; hand-backs carry tensors and strings. Worker processes receive plans
cloudpickled (hook functions are often closures).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from torch import Tensor

from vlens.runtime.vocabulary.locations import Site
from vlens.runtime.vocabulary.readers import Reader
from vlens.runtime.vocabulary.steering import AnySteer

if TYPE_CHECKING:
    from vlens.runtime.vocabulary.locations import AttentionStage, ExplicitAttention

#: The key of ``SamplingParams.extra_args`` that tags a request with its call and index.
TAG_KEY = "vlens_tag"


HookFunction = Callable[[Tensor, Any], Tensor | None]

#: Where a padded batch puts each prompt's padding: after its positions, or before them.
PaddingSide = Literal["left", "right"]


@dataclass(frozen=True)
class NamePlan:
    """One canonical name at one site of one request: ``batch_hooks`` run first, once per engine
    step on the call's padded batch (the hook functions every prompt of the call shares: added
    hooks, ``fwd_hooks``; :mod:`vlens.runtime.hooks.calls`), then the request's own ``hooks``
    (``prompt_hooks``, steers) on its own rows; all may edit. Then, if ``keep``, the (possibly
    edited) value is captured for the cache. Every request of a call has the same names at a
    site, in the same order, with the same ``batch_hooks``."""

    name: str
    read: Reader
    arrange: str | None
    hooks: tuple[HookFunction, ...]
    keep: bool
    batch_hooks: tuple[HookFunction, ...] = ()


@dataclass(frozen=True)
class AttentionPlan:
    """One layer's attention for one request, computed in the worker because hook functions are
    on its scores, pattern or per-head results (:mod:`vlens.runtime.attention.explicit`).

    ``names`` gives each stage's canonical name; ``batch_hooks`` and ``hooks`` the functions on
    it, as in :class:`NamePlan` (stages run in forward order: scores, pattern, result); ``keep``
    the stages whose values, as the hooks leave them, go to the cache."""

    attention: ExplicitAttention
    names: Mapping[AttentionStage, str]
    hooks: Mapping[AttentionStage, tuple[HookFunction, ...]]
    keep: frozenset[AttentionStage] = frozenset()
    batch_hooks: Mapping[AttentionStage, tuple[HookFunction, ...]] = field(default_factory=dict)

    def hooked(self, stage: AttentionStage) -> bool:
        """Whether some hook function is on ``stage``."""
        return bool(self.hooks.get(stage) or self.batch_hooks.get(stage))

    @property
    def forms_pattern(self) -> bool:
        """Whether the layer's scores and pattern are computed (hooks on either)."""
        return self.hooked("scores") or self.hooked("pattern")

    @property
    def forms_results(self) -> bool:
        """Whether per-head results are computed (hooks on them)."""
        return self.hooked("result")


@dataclass(frozen=True)
class RequestPlan:
    """Everything one request (``index`` in the user's call of ``call_size`` prompts) wants,
    grouped by site; on a compiled engine, also the traced names it keeps (``graph_keep``) and
    its ``steering``; the layers whose attention the worker computes for it (``attention``)."""

    index: int
    sites: dict[Site, tuple[NamePlan, ...]]
    graph_keep: frozenset[str] = field(default_factory=frozenset)
    steering: tuple[AnySteer, ...] = ()
    attention: tuple[AttentionPlan, ...] = ()
    call_size: int = 1
    #: the most positions the request runs (its prompt and every new token but the last), where
    #: its call keeps its cache on the host: its kept rows are then written into that cache as
    #: steps end; 0 where not known
    positions: int = 0
    #: whether that cache must be memory the user's process maps from a worker process
    #: (:mod:`vlens.runtime.transfer.host_blocks`) rather than the worker's own
    shared_host: bool = False
    #: where the call's batch puts padding: after each prompt's positions or before them
    padding_side: PaddingSide = "right"

    def kept_names(self) -> frozenset[str]:
        """The names read at sites that this request keeps for its cache."""
        return frozenset(name.name for names in self.sites.values() for name in names if name.keep)

    @property
    def batch_hooked(self) -> bool:
        """Whether hook functions run on the call's batch somewhere (which needs the call's
        prompts prefilled in one engine step)."""
        return any(name.batch_hooks for names in self.sites.values() for name in names) or any(
            any(layer.batch_hooks.values()) for layer in self.attention
        )


Span = tuple[int, int]  # (first position, length)


@dataclass
class Chunk:
    """Rows of one name for one request, starting at sequence position ``first_position``."""

    first_position: int
    value: Tensor


@dataclass
class PaddedRows:
    """One name's kept rows of a call's requests, batch-major: ``values[i, p]`` is request
    ``i``'s position ``p``, zero where nothing was kept; ``spans[i]`` lists request ``i``'s runs
    of consecutive positions."""

    values: Tensor
    spans: list[list[Span]]

    def chunks(self, index: int) -> list[Chunk]:
        """Request ``index``'s runs, as views of :attr:`values`."""
        return [Chunk(first, self.values[index, first : first + n]) for first, n in self.spans[index]]

    def is_batch(self, lengths: Sequence[int]) -> bool:
        """Whether :attr:`values` already is the padded batch of requests of these lengths: each
        request's positions ``0:length`` kept, in one run, and the longest fills the width."""
        return (
            len(lengths) == len(self.spans)
            and self.values.shape[1] == max(lengths)
            and all(spans == [(0, length)] for spans, length in zip(self.spans, lengths))
        )


@dataclass
class RequestCapture:
    """What one request's hook functions' path captured (one chunk per engine step), and the
    first error raised while capturing it.

    ``formed``: derived names the worker formed for this request (attention computed explicitly,
    :class:`AttentionPlan`), as the hooks left them, in TransformerLens's layout without the
    batch axis (``[head, pos, pos]``, ``[pos, head, d_model]``) over every position it ran."""

    chunks: dict[str, list[Chunk]] = field(default_factory=lambda: defaultdict(list))
    error: str | None = None
    cause: BaseException | None = None
    formed: dict[str, Tensor] = field(default_factory=dict)
    #: captures that failed in this process so far: while it stands still, a worker's layout of
    #: a step's requests at its sites, worked out once for every layer, still holds
    failures: ClassVar[int] = 0

    def fail(self, error: str, cause: BaseException | None = None) -> None:
        """Record the request's error (raised in the user's process after the call); its hook
        functions stop."""
        self.error, self.cause = error, cause
        RequestCapture.failures += 1


@dataclass
class Handback:
    """What the workers hand back when a call's requests finish: per request (by tag), what was
    captured where hook functions ran, and errors; per name, what was read over whole steps
    (:class:`PaddedRows`, request ``i`` being the ``i``-th tag the call finished)."""

    captures: dict[str, RequestCapture]
    padded: dict[str, PaddedRows]

    @classmethod
    def of_ranks(cls, ranks: Sequence[Handback]) -> Handback:
        """What the ranks handed back together: the first rank's captures (one rank keeps
        those), and every rank's share of the names read over whole steps (compiled names are
        dealt out over the ranks)."""
        padded = {name: rows for rank in ranks for name, rows in rank.padded.items()}
        return cls(ranks[0].captures, padded)

    def of_request(self, tag: str, index: int) -> Handback:
        """What request ``tag``, the ``index``-th of the call, captured: a hand-back of that one
        request (its rows as views of the call's)."""
        padded = {
            name: PaddedRows(rows.values[index : index + 1], [rows.spans[index]])
            for name, rows in self.padded.items()
        }
        return Handback({tag: self.captures[tag]}, padded)


class HookError(RuntimeError):
    """A user's hook function failed, or returned something vlens cannot write back."""


@dataclass
class ModuleRecord:
    """What one module did while watched: the phases it ran in, how it was called, and whether
    its first output was token-major (one row per token of the step)."""

    class_name: str
    paths: list[str]
    parameters: tuple[str, ...]
    phases: set[str] = field(default_factory=set)
    positional: int = 0
    keywords: tuple[str, ...] = ()
    token_major: bool = True
    #: the arguments that were tensors (by parameter or keyword, else position), the others None
    #: or plain values
    tensors: set[str] = field(default_factory=set)
