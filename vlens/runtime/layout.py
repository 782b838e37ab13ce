"""Which rows of an engine step belong to which request, read from the model runner itself.

One engine step runs every scheduled request as one flat ``[total_tokens, ...]`` batch, in the
runner's own order (which need not be the order of submission). Requests are recognised by the
tag that the user's process puts in ``SamplingParams.extra_args``; vLLM's request ids carry a
random suffix and are never used for that.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

TAG_KEY = "vlens_tag"


@dataclass(frozen=True)
class RequestRows:
    """Rows ``start:stop`` of this step belong to request ``tag``, from sequence position
    ``first_position`` on (the prompt's start on a whole prefill, later on a chunk or a decode)."""

    tag: str
    start: int
    stop: int
    first_position: int
    prompt_length: int

    @property
    def is_prefill(self) -> bool:
        return self.first_position < self.prompt_length


Followed = tuple[str, int] | None  # (tag, prompt length) of a request, None when untagged


def identify(runner: Any, req_id: str) -> Followed:
    """The vlens tag and prompt length of a scheduled request; None if vlens does not follow it."""
    state = runner.requests[req_id]
    extra = getattr(state.sampling_params, "extra_args", None) or {}
    tag = extra.get(TAG_KEY)
    return None if tag is None else (tag, len(state.prompt_token_ids or ()))


def read_step_layout(runner: Any, followed: dict[str, Followed]) -> list[RequestRows]:
    """The rows of every followed request in the step the runner is about to execute.

    ``followed`` memoises request id → (tag, prompt length) across steps.
    Reads the V1 runner's persistent batch: ``input_batch.req_ids`` in row order, the
    ``query_start_loc`` it has just written, and each request's computed-token count.
    """
    batch = runner.input_batch
    n = batch.num_reqs
    starts = runner.query_start_loc.np[: n + 1]
    computed = batch.num_computed_tokens_cpu[:n]
    layout = []
    for index, req_id in enumerate(batch.req_ids[:n]):
        if req_id not in followed:
            followed[req_id] = identify(runner, req_id)
        known = followed[req_id]
        if known is not None:
            tag, prompt_length = known
            rows = RequestRows(
                tag, int(starts[index]), int(starts[index + 1]), int(computed[index]), prompt_length
            )
            layout.append(rows)
    return layout
