"""Rows land on the right request whatever order the model runner puts requests in.

vLLM 0.26's V2 model runner (the CUDA default) sorts each step's requests decodes first, then by
token count; the V1 runner keeps a persistent batch that vLLM itself reorders for some attention
backends. vlens must read the order from the runner, never assume the order of submission. The
V2 runner does not run on CPU, so its adapter is checked against a stand-in with V2's surface and
ordering rule (the V1 path on a real engine: ``tests/engine/test_row_order.py``).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vlens.runtime.steps.layout import TAG_KEY, RequestRows, follow_steps, runner_kind
from vlens.runtime.transfer.messages import Chunk, RequestCapture
from vlens.runtime.worker import handed_back

TEXTS = [
    "The first prompt is of middling length",
    "Hi",
    "A third prompt, the longest of the three by a good many tokens, to make lengths differ",
]


def new_request(req_id: str, prompt_length: int, tag: str | None) -> SimpleNamespace:
    extra = None if tag is None else {TAG_KEY: tag}
    return SimpleNamespace(
        req_id=req_id,
        prompt_token_ids=list(range(prompt_length)),
        sampling_params=SimpleNamespace(extra_args=extra),
    )


class V2Like:
    """The surface of vLLM 0.26's V2 runner that vlens uses: ``execute_model`` adds new requests,
    builds a fresh input batch sorted as V2 sorts it (``sort_batch_req_ids``), then calls the
    model."""

    def __init__(self, forward) -> None:
        self.forward = forward
        self.computed: dict[str, int] = {}

    def add_requests(self, scheduler_output) -> None:
        for new in scheduler_output.scheduled_new_reqs:
            self.computed[new.req_id] = 0

    def prepare_inputs(self, scheduler_output, batch_desc=None) -> SimpleNamespace:
        tokens = scheduler_output.num_scheduled_tokens
        req_ids = sorted(tokens, key=lambda r: (tokens[r] != 1, tokens[r]))
        counts = np.array([tokens[r] for r in req_ids], dtype=np.int32)
        return SimpleNamespace(
            req_ids=req_ids,
            num_reqs=len(req_ids),
            query_start_loc_np=np.concatenate([[0], np.cumsum(counts)]).astype(np.int32),
            num_computed_tokens_np=np.array([self.computed[r] for r in req_ids], dtype=np.int32),
        )

    def execute_model(self, scheduler_output, dummy_run: bool = False):
        if not dummy_run:
            self.add_requests(scheduler_output)
            self.prepare_inputs(scheduler_output, None)
        self.forward()
        if not dummy_run:
            for req_id, count in scheduler_output.num_scheduled_tokens.items():
                self.computed[req_id] += count


def step(new: list[SimpleNamespace], tokens: dict[str, int]) -> SimpleNamespace:
    return SimpleNamespace(scheduled_new_reqs=new, num_scheduled_tokens=tokens)


def step_state() -> SimpleNamespace:
    """A runtime's step state that records the layout it sees when a step starts and ends."""
    state = SimpleNamespace(wanted={"on": True}, followed={}, layout=None, around=[])
    state.step_started = lambda: state.around.append(("started", state.layout))
    state.step_finished = lambda: state.around.append(("finished", state.layout))
    return state


def test_v2_rows_follow_the_runners_sorted_order():
    state = step_state()
    seen: list[list[RequestRows] | None] = []
    runner = V2Like(lambda: seen.append(state.layout))
    assert runner_kind(runner) == "v2"
    follow_steps(runner, state)

    # Submitted with 5, 9 and 3 tokens; V2 runs them as [0,3) [3,8) [8,17), as seen on the H200.
    runner.execute_model(
        step(
            [new_request("a-x", 5, "0:0"), new_request("b-x", 9, "0:1"),
             new_request("c-x", 3, "0:2")],
            {"a-x": 5, "b-x": 9, "c-x": 3},
        )
    )
    assert seen[-1] == [
        RequestRows("0:2", 0, 3, 0, 3),
        RequestRows("0:0", 3, 8, 0, 5),
        RequestRows("0:1", 8, 17, 0, 9),
    ]
    assert state.layout is None, "the layout outlived the step"
    assert state.around == [("started", seen[-1]), ("finished", seen[-1])]

    # Decodes run first; a new prompt (and an untagged request) join the step.
    runner.execute_model(
        step(
            [new_request("d-x", 4, "0:3"), new_request("plain", 2, None)],
            {"a-x": 1, "b-x": 1, "c-x": 1, "d-x": 4, "plain": 2},
        )
    )
    assert seen[-1] == [
        RequestRows("0:0", 0, 1, 5, 5),
        RequestRows("0:1", 1, 2, 9, 9),
        RequestRows("0:2", 2, 3, 3, 3),
        RequestRows("0:3", 5, 9, 0, 4),
    ]
    assert not seen[-1][0].is_prefill and seen[-1][3].is_prefill

    runner.execute_model(step([], {"a-x": 7}), dummy_run=True)
    assert seen[-1] is None, "a dummy run has no requests"
    state.wanted = {}
    runner.execute_model(step([], {"a-x": 1}))
    assert seen[-1] is None, "nothing is followed: no layout is read"


def test_v1_rows_follow_the_persistent_batch():
    state = step_state()
    seen = []
    runner = SimpleNamespace(
        requests={
            rid: SimpleNamespace(
                sampling_params=SimpleNamespace(extra_args={TAG_KEY: tag} if tag else None),
                prompt_token_ids=[0] * n,
            )
            for rid, tag, n in (("r0", "1:0", 4), ("r1", None, 2), ("r2", "1:1", 6))
        },
        input_batch=SimpleNamespace(
            req_ids=["r2", "r1", "r0"], num_reqs=3, num_computed_tokens_cpu=np.array([6, 0, 0])
        ),
        query_start_loc=SimpleNamespace(np=np.array([0, 1, 3, 7])),
        _model_forward=lambda: seen.append(state.layout),
    )
    assert runner_kind(runner) == "v1"
    follow_steps(runner, state)
    runner._model_forward()
    assert seen[-1] == [RequestRows("1:1", 0, 1, 6, 6), RequestRows("1:0", 3, 7, 0, 4)]
    assert state.around == [("started", seen[-1]), ("finished", seen[-1])]
    assert state.followed == {"r2": ("1:1", 6), "r1": None, "r0": ("1:0", 4)}
    assert state.layout is None


def test_unknown_runner_is_refused():
    with pytest.raises(NotImplementedError, match="model runner"):
        runner_kind(SimpleNamespace())


def test_hand_back_joins_runs_of_positions_and_keeps_gaps():
    capture = RequestCapture()
    rows = torch.arange(12.0).reshape(6, 2)
    # Steps arrive out of order; positions 3..4 were never computed (say, a prefix-cache hit).
    capture.chunks["x"] += [Chunk(2, rows[2:3]), Chunk(0, rows[0:2]), Chunk(5, rows[5:6])]
    done = handed_back({"t": capture})["t"]
    assert [chunk.first_position for chunk in done.chunks["x"]] == [0, 5]
    torch.testing.assert_close(done.chunks["x"][0].value, rows[0:3])
    torch.testing.assert_close(done.chunks["x"][1].value, rows[5:6])
    assert all(chunk.value.device.type == "cpu" for chunk in done.chunks["x"])
