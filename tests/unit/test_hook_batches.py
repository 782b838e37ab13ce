"""A step's rows as hook functions see them: a call's padded batch (right or left), read once and
written back once, padding going nowhere (:class:`vlens.runtime.hooks.batches.HookBatch`,
:func:`vlens.runtime.hooks.calls.run_hooks`); and several requests' own functions read and written
back together (:func:`vlens.runtime.hooks.calls.run_hooks_together`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from torch import Tensor, nn

from vlens.runtime.hooks.batches import HookBatch, Member
from vlens.runtime.hooks.calls import Hook, run_hooks, run_hooks_together
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


def step(lengths: list[int], prefill: bool = True) -> tuple[NarrowedCall, list[HookBatch]]:
    """A step of one request per length (a call's prompts, each alone), with a fused
    ``(hidden, residual)`` output."""
    hidden, residual = torch.randn(sum(lengths), 8), torch.randn(sum(lengths), 8)
    call = NarrowedCall(nn.Identity(), None, (), {}, (hidden, residual))
    batches, start = [], 0
    for index, length in enumerate(lengths):
        first = 0 if prefill else 20
        rows = RequestRows(f"call:{index}", start, start + length, first, length if prefill else 5)
        plan = RequestPlan(index, {}, call_size=len(lengths))
        batches.append(HookBatch.of_request(Member(rows, plan, RequestCapture())))
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

    plan = NamePlan("blocks.0.hook_resid_post", reader, None, (add_index,), False)
    failures = run_hooks_together(plan, batches, call, {})
    assert failures == {}
    assert reader.counts == {"read": 1, "write": 1}  # a sum is written as (new, 0), unread
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
                    (scale_second_half,), False)
    run_hooks_together(plan, batches, call, {})
    for batch in batches:
        run_hooks(plan, plan.hooks, batch, twin, {})
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
                    (edit_then_fail_on_one,), False)
    failures = run_hooks_together(plan, batches, call, {})
    assert list(failures) == [id(batches[1])]
    assert "edit_then_fail_on_one" in str(failures[id(batches[1])])
    expected = before.clone()
    expected[0:2] += 1.0
    expected[4:6] += 1.0
    torch.testing.assert_close(sums(call), expected, rtol=0, atol=1e-6)


def test_untouched_rows_are_written_back_bit_for_bit() -> None:
    """What the next layer reads (the pair's sum) is unchanged bit for bit in the rows no hook
    edited, and exactly the hook's value in the edited ones."""
    call, batches = step([3, 3])
    before = sums(call).clone()

    def edit_first(x: Tensor, hook: Hook) -> None:
        if hook.request == 0:
            x[:] = 0.0

    plan = NamePlan("blocks.0.hook_resid_post", OutputOf(0, plus=1), None,
                    (edit_first,), False)
    run_hooks_together(plan, batches, call, {})
    assert torch.equal(sums(call)[3:], before[3:])
    assert torch.equal(sums(call)[:3], torch.zeros_like(before[:3]))


@pytest.mark.parametrize("shape", [(1, 3, 4), (3, 8)])
def test_a_replacement_of_the_wrong_shape_fails_its_batch(shape: tuple[int, ...]) -> None:
    call, batches = step([3, 3])

    def wrong(x: Tensor, hook: Hook) -> Tensor | None:
        return torch.zeros(shape) if hook.request == 0 else None

    plan = NamePlan("blocks.0.hook_resid_post", OutputOf(0, plus=1), None, (wrong,), False)
    failures = run_hooks_together(plan, batches, call, {})
    assert list(failures) == [id(batches[0])]
    assert "expected (1, 3, 8)" in str(failures[id(batches[0])])


# ---- a call's padded batch ---------------------------------------------------------------------


def call_step(
    lengths: list[int | None], side: str = "right", first: int = 0
) -> tuple[NarrowedCall, HookBatch]:
    """A step holding a call's prompts of these ``lengths`` (None: a prompt with no rows in the
    step), in reverse order of the call, as one batch."""
    present = [(index, length) for index, length in enumerate(lengths) if length is not None]
    total = sum(length for _, length in present)
    hidden, residual = torch.randn(total, 4), torch.randn(total, 4)
    call = NarrowedCall(nn.Identity(), None, (), {}, (hidden, residual))
    members, start = [], 0
    for index, length in reversed(present):
        rows = RequestRows(f"call:{index}", start, start + length, first, first + length)
        plan = RequestPlan(index, {}, call_size=len(lengths), padding_side=side)  # type: ignore[arg-type]
        members.append(Member(rows, plan, RequestCapture()))
        start += length
    return call, HookBatch.of_call(sorted(members, key=lambda member: member.plan.index))


@pytest.mark.parametrize("side", ["right", "left"])
def test_a_call_of_unequal_prompts_is_one_padded_batch(side: str) -> None:
    call, batch = call_step([2, 4, 3], side)
    rows = sums(call).clone()  # prompt 2's rows first in the step, then 1's, then 0's
    seen: dict[str, Tensor] = {}

    def look(x: Tensor, hook: Hook) -> None:
        seen.update(x=x.clone(), mask=hook.attention_mask, positions=hook.positions)
        assert hook.requests == (0, 1, 2) and hook.request is None and hook.lengths == (2, 4, 3)

    plan = NamePlan("blocks.0.hook_resid_post", OutputOf(0, plus=1), None, (), False)
    run_hooks(plan, (look,), batch, call, {})
    x, mask = seen["x"], seen["mask"]
    assert x.shape == (3, 4, 4)
    own = {2: rows[0:3], 1: rows[3:7], 0: rows[7:9]}
    for index, length in enumerate((2, 4, 3)):
        real = slice(4 - length, 4) if side == "left" else slice(0, length)
        assert torch.equal(x[index, real], own[index])
        assert mask[index].tolist() == [real.start <= p < real.stop for p in range(4)]
        assert not x[index][~mask[index]].any()  # padding holds zeros
        assert seen["positions"][index][mask[index]].tolist() == list(range(length))
        assert (seen["positions"][index][~mask[index]] == -1).all()


def test_an_edit_of_one_prompt_reaches_it_alone_and_padding_goes_nowhere() -> None:
    call, batch = call_step([2, 4, 3])
    before = sums(call).clone()

    def edit(x: Tensor, hook: Hook) -> None:
        x[0] += 1.0  # prompt 0's rows and its padding
        x[2, 3] += 5.0  # padding of prompt 2 (3 rows)

    plan = NamePlan("blocks.0.hook_resid_post", OutputOf(0, plus=1), None, (), False)
    run_hooks(plan, (edit,), batch, call, {})
    expected = before.clone()
    expected[7:9] += 1.0  # prompt 0 is last in the step
    torch.testing.assert_close(sums(call), expected, rtol=0, atol=1e-6)


def test_a_prompt_absent_from_the_step_is_all_padding() -> None:
    call, batch = call_step([None, 1, 1], first=9)  # decode: prompt 0 has finished
    seen: list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]] = []

    def look(x: Tensor, hook: Hook) -> None:
        seen.append((tuple(x.shape), hook.lengths, hook.first_positions))
        assert not x[0].any()

    plan = NamePlan("blocks.0.hook_resid_post", OutputOf(0, plus=1), None, (), False)
    run_hooks(plan, (look,), batch, call, {})
    assert seen == [((3, 1, 4), (0, 1, 1), (-1, 9, 9))]


def test_equal_prompts_are_read_without_padding_and_in_order_as_one_span() -> None:
    call, batch = call_step([3, 3])
    assert batch.dense and batch.span is None  # in the step in reverse order: gathered
    rows = RequestRows("call:0", 0, 3, 0, 3), RequestRows("call:1", 3, 6, 0, 3)
    plans = [RequestPlan(index, {}, call_size=2) for index in range(2)]
    dense = HookBatch.of_call([Member(r, p, RequestCapture()) for r, p in zip(rows, plans)])
    assert dense.dense and dense.span is not None
    assert torch.equal(dense.unpadded(dense.padded(sums(call))), sums(call))
