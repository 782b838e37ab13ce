"""Whole-step reads land in the padded batch at the right request and position, whatever order
the steps put requests in; the batch is handed over uncopied only when it is complete."""

from __future__ import annotations

import pytest
import torch

from vlens.engine.assembly import padded_batch
from vlens.runtime.steps.kept_steps import KeptSteps, Segment, copy_rows, row_selection
from vlens.runtime.transfer.messages import Chunk

KEEP_X = frozenset({"x"})


def rows(*values: float) -> torch.Tensor:
    return torch.tensor(values).reshape(-1, 1)


def two_steps() -> KeptSteps:
    """A prefill step (a: 3 positions, b: 2, c: 1) then a decode step listing b before a."""
    store = KeptSteps()
    store.add("x", [Segment("a", 3, 0), Segment("b", 2, 0), Segment("c", 1, 0)], rows(0, 1, 2, 3, 4, 5))
    store.add("x", [Segment("b", 1, 2), Segment("a", 1, 3)], rows(10, 11))
    return store


def test_rows_land_at_their_request_and_position_zero_padded():
    taken = two_steps().take(["a", "b"], {"a": KEEP_X, "b": KEEP_X}, "cpu")["x"]
    assert taken.values.squeeze(-1).tolist() == [[0, 1, 2, 11], [3, 4, 10, 0]]
    assert taken.spans == [[(0, 4)], [(0, 3)]]
    assert taken.is_batch([4, 3])
    assert not taken.is_batch([4, 4])  # b's last position was never kept


def test_only_the_finishing_requests_that_keep_a_name_are_taken():
    store = two_steps()
    taken = store.take(["c", "b"], {"b": KEEP_X, "c": frozenset()}, "cpu")["x"]
    assert taken.values.squeeze(-1).tolist() == [[0, 0, 0], [3, 4, 10]]
    assert taken.spans == [[], [(0, 3)]]
    assert store.take(["c"], {"c": frozenset()}, "cpu") == {}


def test_a_gap_stays_a_gap_and_the_batch_is_not_complete():
    store = KeptSteps()
    store.add("x", [Segment("a", 2, 0)], rows(1, 2))
    store.add("x", [Segment("a", 1, 4)], rows(5))  # positions 2..3 never computed
    taken = store.take(["a"], {"a": KEEP_X}, "cpu")["x"]
    assert taken.spans == [[(0, 2), (4, 1)]]
    assert not taken.is_batch([5])
    assert [chunk.first_position for chunk in taken.chunks(0)] == [0, 4]
    with pytest.raises(RuntimeError, match="positions 2..3 were never computed"):
        padded_batch("x", [[]], taken, [5])


def test_names_sharing_a_step_layout_each_get_their_own_rows():
    store = KeptSteps()
    segments = [Segment("b", 1, 0), Segment("a", 1, 0)]
    store.add("x", segments, rows(1, 2))
    store.add("y", segments, rows(3, 4))
    taken = store.take(["a", "b"], {"a": frozenset({"x", "y"}), "b": frozenset({"x", "y"})}, "cpu")
    assert taken["x"].values.squeeze(-1).tolist() == [[2], [1]]
    assert taken["y"].values.squeeze(-1).tolist() == [[4], [3]]


def test_a_complete_batch_is_handed_over_uncopied_and_mixed_sources_are_joined():
    taken = two_steps().take(["a", "b"], {"a": KEEP_X, "b": KEEP_X}, "cpu")["x"]
    assert padded_batch("x", [[], []], taken, [4, 3]) is taken.values
    # b's last position came from the hook functions' path: joined with the whole-step rows
    store = KeptSteps()
    store.add("x", [Segment("a", 2, 0), Segment("b", 1, 0)], rows(1, 2, 3))
    partial = store.take(["a", "b"], {"a": KEEP_X, "b": KEEP_X}, "cpu")["x"]
    value = padded_batch("x", [[], [Chunk(1, rows(9))]], partial, [2, 2])
    assert value.squeeze(-1).tolist() == [[1, 2], [3, 9]]


def test_row_selection_is_a_slice_for_consecutive_spans_else_an_index():
    value = torch.arange(10.0)
    assert row_selection([(2, 4), (4, 7)], value.device) == slice(2, 7)
    gathered = row_selection([(0, 2), (5, 7)], value.device)
    assert copy_rows(value, gathered).tolist() == [0, 1, 5, 6]
    copied = copy_rows(value, slice(2, 4))
    copied[0] = -1
    assert value[2] == 2  # a copy, not a view of the step's buffer


def test_rows_past_a_request_s_end_are_left_out():
    """With asynchronous scheduling vLLM runs one more forward for a request that has just
    finished (on CUDA): that row is not part of the request's cache, wherever it was kept."""
    store = KeptSteps()
    store.add("x", [Segment("a", 3, 0), Segment("b", 2, 0)], rows(0, 1, 2, 3, 4))
    store.add("x", [Segment("a", 1, 3), Segment("b", 1, 2)], rows(10, 11))  # b's is one too many
    whole = store.take(["a", "b"], {"a": KEEP_X, "b": KEEP_X}, "cpu")["x"]
    value = padded_batch("x", [[], []], whole, [4, 2])
    assert value.squeeze(-1).tolist() == [[0, 1, 2, 10], [3, 4, 0, 0]]
    hooked = [[Chunk(0, rows(0, 1, 2)), Chunk(3, rows(10))], [Chunk(0, rows(3, 4)), Chunk(2, rows(11))]]
    value = padded_batch("x", hooked, None, [4, 2])
    assert value.squeeze(-1).tolist() == [[0, 1, 2, 10], [3, 4, 0, 0]]
    with pytest.raises(RuntimeError, match="captured 2 positions, expected 4"):  # short stays short
        padded_batch("x", [[Chunk(0, rows(3, 4))]], None, [4])


def test_forget_drops_the_steps_no_running_request_has_rows_in():
    store = KeptSteps()
    only_a, a_and_b = [Segment("a", 1, 0)], [Segment("a", 1, 1), Segment("b", 2, 0)]
    store.add("x", only_a, torch.zeros(1, 3))
    store.add("x", a_and_b, torch.ones(3, 3))
    store.add("y", only_a, torch.zeros(1, 3))
    store.forget(["a"])
    assert list(store.entries) == ["x"] and len(store.entries["x"]) == 1
    assert store.entries["x"][0][0] is a_and_b


def test_one_request_taken_from_many_is_its_row_of_the_whole_batch():
    """A server takes one finished request at a time, from its own runs: the same rows, spans
    and replaced rows as taking every request at once."""
    def store() -> KeptSteps:
        steps = KeptSteps()
        steps.add("x", [Segment("a", 3, 0), Segment("b", 2, 0), Segment("c", 1, 0)],
                  rows(0, 1, 2, 20, 21, 30))
        steps.add("x", [Segment("b", 1, 2), Segment("a", 2, 0)], rows(22, 10, 11))  # a again
        steps.add("x", [Segment("c", 1, 1), Segment("a", 1, 2), Segment("b", 1, 4)],
                  rows(31, 12, 24))  # b skips position 3
        return steps

    keep = {"a": KEEP_X, "b": KEEP_X, "c": KEEP_X}
    whole = store().take(["a", "b", "c"], keep, "cpu")["x"]
    for index, tag in enumerate("abc"):
        alone = store().take([tag], keep, "cpu")["x"]
        width = alone.values.shape[1]
        assert alone.values[0].tolist() == whole.values[index, :width].tolist(), tag
        assert alone.spans == [whole.spans[index]], tag
    assert store().take(["a"], keep, "cpu")["x"].values.squeeze(-1).tolist() == [[10, 11, 12]]


def test_forgotten_requests_leave_no_step_behind():
    steps = KeptSteps()
    steps.add("x", [Segment("a", 1, 0), Segment("b", 1, 0)], rows(1, 2))
    steps.add("x", [Segment("b", 1, 1)], rows(3))
    for index in range(6):  # other requests' steps
        steps.add("x", [Segment(f"r{index}", 1, 0)], rows(index))
    steps.forget(["b"])
    assert steps.take(["a"], {"a": KEEP_X}, "cpu")["x"].values.squeeze(-1).tolist() == [[1]]
    steps.forget(["a", "r0", "r1"])
    held = [segments for segments, _ in steps.entries["x"]]
    assert all(any(s.tag.startswith("r") for s in segments) for segments in held)
    assert len(held) == 4
