"""Hook functions of several batches of one step, read and written back once
(:func:`vlens.runtime.hooks.calls.run_hooks_together`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from torch import Tensor, nn

from vlens.runtime.hooks.batches import Member, StepBatch
from vlens.runtime.hooks.calls import Hook, refuse_part_of_a_prefill, run_hooks, run_hooks_together
from vlens.runtime.sites.torch_hooks import NarrowedCall
from vlens.runtime.steps.layout import RequestRows
from vlens.runtime.transfer.messages import NamePlan, RequestCapture, RequestPlan
from vlens.runtime.vocabulary.readers import OutputOf


@dataclass(frozen=True)
class CountedOutput(OutputOf):
    """The fused residual pair's sum, counting reads and writes."""

    counts: dict[str, int] = field(default_factory=lambda: {"read": 0, "write": 0}, compare=False)

    def __call__(self, call):  # type: ignore[no-untyped-def]
        self.counts["read"] += 1
        return super().__call__(call)

    def write(self, call, new):  # type: ignore[no-untyped-def]
        self.counts["write"] += 1
        super().write(call, new)


def step(lengths: list[int], prefill: bool = True) -> tuple[NarrowedCall, list[StepBatch]]:
    """A step of one request per length (a call's prompts, each alone), with a fused
    ``(hidden, residual)`` output."""
    hidden, residual = torch.randn(sum(lengths), 8), torch.randn(sum(lengths), 8)
    call = NarrowedCall(nn.Identity(), None, (), {}, (hidden, residual))
    batches, start = [], 0
    for index, length in enumerate(lengths):
        first = 0 if prefill else 20
        rows = RequestRows(f"call:{index}", start, start + length, first, length if prefill else 5)
        plan = RequestPlan(index, {}, call_size=len(lengths))
        batches.append(StepBatch.of([Member(rows, plan, RequestCapture())]))
        start += length
    return call, batches


def sums(call: NarrowedCall) -> Tensor:
    return call.result[0] + call.result[1]


def test_one_read_and_one_write_for_every_batch_each_seeing_its_own_rows() -> None:
    call, batches = step([3, 5, 2])
    before = sums(call).clone()
    reader = CountedOutput(0, plus=1)
    seen: list[tuple[int | None, tuple[int, ...]]] = []

    def add_index(x: Tensor, hook: Hook) -> Tensor:
        seen.append((hook.request, tuple(x.shape)))
        return x + (hook.request or 0) + 1

    plan = NamePlan("blocks.0.hook_resid_post", reader, None, (add_index,), False, True)
    failures = run_hooks_together(plan, batches, call, {}, refuse_part_of_a_prefill)
    assert failures == {}
    assert reader.counts == {"read": 2, "write": 1}  # a sum's write reads it once more
    assert seen == [(0, (1, 3, 8)), (1, (1, 5, 8)), (2, (1, 2, 8))]
    offsets = torch.tensor([1.0] * 3 + [2.0] * 5 + [3.0] * 2)[:, None]
    torch.testing.assert_close(sums(call), before + offsets, rtol=0, atol=1e-6)


def test_the_same_edits_as_batch_by_batch() -> None:
    torch.manual_seed(0)
    call, batches = step([4, 1, 3])
    twin = NarrowedCall(nn.Identity(), None, (), {}, tuple(t.clone() for t in call.result))

    def scale_second_half(x: Tensor, hook: Hook) -> None:
        x[:, x.shape[1] // 2 :] *= 3.0

    plan = NamePlan("blocks.0.hook_resid_post", OutputOf(0, plus=1), None,
                    (scale_second_half,), False, True)
    run_hooks_together(plan, batches, call, {})
    for batch in batches:
        run_hooks(plan, batch, twin, {})
    torch.testing.assert_close(call.result[0], twin.result[0], rtol=0, atol=0)
    torch.testing.assert_close(call.result[1], twin.result[1], rtol=0, atol=0)


def test_a_failing_batch_keeps_its_rows_and_the_others_their_edits() -> None:
    call, batches = step([2, 2, 2], prefill=False)
    before = sums(call).clone()

    def edit_then_fail_on_one(x: Tensor, hook: Hook) -> None:
        x += 1.0
        if hook.request == 1:
            raise ValueError("no")

    plan = NamePlan("blocks.0.hook_resid_post", OutputOf(0, plus=1), None,
                    (edit_then_fail_on_one,), False, True)
    failures = run_hooks_together(plan, batches, call, {})
    assert list(failures) == [id(batches[1])]
    assert "edit_then_fail_on_one" in str(failures[id(batches[1])])
    expected = before.clone()
    expected[0:2] += 1.0
    expected[4:6] += 1.0
    torch.testing.assert_close(sums(call), expected, rtol=0, atol=1e-6)


def test_untouched_rows_are_written_back_bit_for_bit() -> None:
    call, batches = step([3, 3])
    hidden, residual = (t.clone() for t in call.result)

    def edit_first(x: Tensor, hook: Hook) -> None:
        if hook.request == 0:
            x[:] = 0.0

    plan = NamePlan("blocks.0.hook_resid_post", OutputOf(0, plus=1), None,
                    (edit_first,), False, True)
    run_hooks_together(plan, batches, call, {})
    assert torch.equal(call.result[0][3:], hidden[3:])
    assert torch.equal(call.result[1], residual)


@pytest.mark.parametrize("shape", [(1, 3, 4), (3, 8)])
def test_a_replacement_of_the_wrong_shape_fails_its_batch(shape: tuple[int, ...]) -> None:
    call, batches = step([3, 3])

    def wrong(x: Tensor, hook: Hook) -> Tensor | None:
        return torch.zeros(shape) if hook.request == 0 else None

    plan = NamePlan("blocks.0.hook_resid_post", OutputOf(0, plus=1), None, (wrong,), False, True)
    failures = run_hooks_together(plan, batches, call, {})
    assert list(failures) == [id(batches[0])]
    assert "expected (1, 3, 8)" in str(failures[id(batches[0])])
