"""Rows land on the right request whatever order the model runner puts requests in: a real
engine (the V1 runner on the CPU) whose batch is reversed before every step, as vLLM itself
reorders it for some attention backends (the runners' adapters alone:
``tests/unit/test_layout.py``)."""

from __future__ import annotations

import pytest
import torch

from vlens.runtime.steps.layout import TAG_KEY

TEXTS = [
    "The first prompt is of middling length",
    "Hi",
    "A third prompt, the longest of the three by a good many tokens, to make lengths differ",
]


def runner_of(model):
    return model.engine.llm.llm_engine.model_executor.driver_worker.worker.model_runner


@pytest.fixture
def reversed_batches(monkeypatch):
    """Reverse the V1 runner's persistent batch before every step (where vLLM reorders it for
    attention backends); yields the tag order of each step's rows."""
    orders: list[list[str]] = []

    def install(model):
        runner = runner_of(model)
        reorder = runner._may_reorder_batch

        def reverse(scheduler_output):
            reorder(scheduler_output)
            batch = runner.input_batch
            n = batch.num_reqs
            for i in range(n // 2):
                batch.swap_states(i, n - 1 - i)
            tags = [
                (runner.requests[r].sampling_params.extra_args or {}).get(TAG_KEY)
                for r in batch.req_ids[:n]
            ]
            orders.append(tags)

        monkeypatch.setattr(runner, "_may_reorder_batch", reverse)
        return orders

    return install


def test_captures_land_on_their_request_when_rows_are_reversed(hooked, reversed_batches):
    model = hooked("qwen3")
    solo = [model.run_with_cache(text, max_new_tokens=3)[1] for text in TEXTS]
    orders = reversed_batches(model)
    _, batch = model.run_with_cache(TEXTS, max_new_tokens=3)
    first = [int(tag.split(":")[1]) for tag in orders[0]]
    assert first == [2, 1, 0], f"the batch was not reversed: {orders[0]}"
    for index, alone in enumerate(solo):
        assert int(batch.lengths[index]) == int(alone.lengths[0])
        for name in ("blocks.0.hook_resid_pre", "blocks.1.attn.hook_z", "blocks.2.hook_resid_post",
                     "unembed.hook_out"):
            torch.testing.assert_close(
                batch.unpadded(name, index), alone[name][0], rtol=1e-5, atol=1e-5, msg=name
            )


def test_steering_stays_in_its_request_when_rows_are_reversed(hooked, reversed_batches):
    model = hooked("qwen3")
    vector = 20 * torch.randn(model.cfg.d_model, generator=torch.Generator().manual_seed(3))

    def steer(x, hook):
        return x + vector.to(x.device, x.dtype)

    name = "blocks.1.hook_resid_post"
    kwargs = dict(max_new_tokens=6, do_sample=False, stop_at_eos=False, return_type="result")
    plain = [model.generate(text, **kwargs)[0] for text in TEXTS]
    steered = model.generate(TEXTS[0], fwd_hooks=[(name, steer)], **kwargs)[0]
    assert steered != plain[0], "the steering vector changed nothing: the test proves nothing"
    orders = reversed_batches(model)
    together = model.generate(TEXTS, prompt_hooks=[[(name, steer)], [], []], **kwargs)
    assert orders and [int(t.split(":")[1]) for t in orders[0]] == [2, 1, 0]
    assert together == [steered, plain[1], plain[2]]


def test_a_batch_hook_edits_each_prompt_s_rows_in_either_row_order(hooked, reversed_batches):
    """A shared hook function at decode steps (prompts of different lengths: one batch) gives
    each prompt of its batch its own edit; read as one span of rows where the step holds them in
    the call's order, one by one where it does not (reversed), with the same result as the same
    edits given per prompt."""
    model = hooked("qwen3")
    vector = 20 * torch.randn(model.cfg.d_model, generator=torch.Generator().manual_seed(4))
    batches: list[tuple[int, ...]] = []

    def steer_by_index(x, hook):
        if not hook.is_prefill:
            batches.append(hook.requests)
        scale = torch.tensor([1.0 + i for i in hook.requests], device=x.device, dtype=x.dtype)
        return x + scale[:, None, None] * vector.to(x.device, x.dtype)

    def steer_one(index):
        return lambda x, hook: x + (1.0 + index) * vector.to(x.device, x.dtype)

    name = "blocks.1.hook_resid_post"
    kwargs = dict(max_new_tokens=5, do_sample=False, stop_at_eos=False, return_type="result")
    one_by_one = model.generate(TEXTS, prompt_hooks=[[(name, steer_one(i))] for i in range(3)],
                                **kwargs)
    in_order = model.generate(TEXTS, fwd_hooks=[(name, steer_by_index)], **kwargs)
    assert batches == [(0, 1, 2)] * 4, "the decode steps did not run as one batch"
    orders = reversed_batches(model)
    reversed_rows = model.generate(TEXTS, fwd_hooks=[(name, steer_by_index)], **kwargs)
    assert [int(t.split(":")[1]) for t in orders[-1]] == [2, 1, 0]
    assert in_order == one_by_one and reversed_rows == one_by_one
    assert one_by_one != model.generate(TEXTS, **kwargs), "the steer must change the tokens"
