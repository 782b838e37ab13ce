"""A step's kept rows as pitched copies (what the GPU's copy engines carry out): emulated here
byte for byte, they put every kept row of every name at its host row and touch nothing else,
in the fewest calls of the two ways, and never with a pitch beyond the device's limit."""

from __future__ import annotations

import numpy as np
import pytest

from vlens.runtime.transfer.pitched_copy import (
    Copy,
    Runs,
    _as_one_series,
    _greedy_series,
    pitched_copies,
)

ROW_BYTES = 8
NO_LIMIT = 1 << 40


def carried_out(copies: list[Copy], host: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """What the copies leave in ``host`` (bytes), read from ``rows`` (bytes)."""
    host = host.copy()
    for copy in copies:
        assert copy.width <= copy.target_pitch and copy.width <= copy.source_pitch
        for piece in range(copy.height):
            target = copy.target + piece * copy.target_pitch
            source = copy.source + piece * copy.source_pitch
            host[target : target + copy.width] = rows[source : source + copy.width]
    return host


def check(targets: list[int], kept: list[bool], names: int, host_rows: int,
          max_pitch: int = NO_LIMIT) -> list[Copy]:
    targets_array, kept_array = np.array(targets), np.array(kept)
    step_rows = len(targets)
    rng = np.random.default_rng(0)
    rows = rng.integers(1, 255, (names, step_rows, ROW_BYTES), dtype=np.uint8)
    host = np.zeros((names, host_rows, ROW_BYTES), dtype=np.uint8)
    expected = host.copy()
    for row in np.flatnonzero(kept_array):
        expected[:, targets_array[row]] = rows[:, row]
    runs = Runs.of(targets_array, kept_array)
    copies = pitched_copies(runs, names, step_rows, host_rows, ROW_BYTES, max_pitch)
    assert all(c.target_pitch <= max_pitch and c.source_pitch <= max_pitch for c in copies
               if c.height > 1)
    result = carried_out(copies, host.reshape(-1), rows.reshape(-1))
    np.testing.assert_array_equal(result.reshape(host.shape), expected)
    return copies


def decode(width: int, positions: list[int]) -> list[int]:
    return [request * width + position for request, position in enumerate(positions)]


def test_a_decode_step_at_one_position_is_one_copy_per_name():
    copies = check(decode(10, [4] * 8), [True] * 8, names=3, host_rows=81)
    assert len(copies) == 3 and all(copy.height == 8 for copy in copies)


def test_a_prefill_of_equal_prompts_is_one_copy_per_name():
    targets = [request * 10 + position for request in range(4) for position in range(5)]
    copies = check(targets, [True] * 20, names=3, host_rows=41)
    assert len(copies) == 3 and all(copy.height == 4 for copy in copies)


def test_few_runs_are_one_copy_each_across_the_names():
    targets = [3, 4, 5, 20, 21]  # two requests' runs
    copies = check(targets, [True] * 5, names=4, host_rows=41)
    assert len(copies) == 2 and all(copy.height == 4 for copy in copies)


@pytest.mark.parametrize("names", [1, 2, 7])
def test_mixed_positions_orders_and_dropped_rows_land_exactly(names):
    rng = np.random.default_rng(names)
    width, batch = 12, 9
    order = rng.permutation(batch)
    lengths = rng.integers(1, 4, batch)
    firsts = rng.integers(0, width - 3, batch)
    targets = [int(r * width + f + k) for r, f, n in zip(order, firsts, lengths) for k in range(n)]
    kept = (rng.random(len(targets)) > 0.2).tolist()  # rows past a request's positions
    check(targets, kept, names, host_rows=batch * width + 1)


def test_no_pitch_exceeds_the_device_limit():
    """Host rows too far apart for a copy across the names: the series way is taken, and a
    series whose step would exceed the limit is cut."""
    host_rows = 200
    limit = 100 * ROW_BYTES  # below the names' stride of 200 rows
    copies = check(decode(20, [3] * 6), [True] * 6, names=2, host_rows=host_rows, max_pitch=limit)
    assert all(copy.height == 6 for copy in copies)
    copies = check(decode(150, [3] * 2), [True] * 2, names=2, host_rows=301, max_pitch=limit)
    assert all(copy.height == 1 for copy in copies)


@pytest.mark.parametrize("seed", range(6))
def test_one_series_worked_out_with_arrays_is_the_greedy_ones(seed):
    """The array shortcut of a step whose runs make one series (every decode step of requests
    at one position) says what the run-by-run way says, and steps aside where it says more."""
    rng = np.random.default_rng(seed)
    count, length, step = int(rng.integers(1, 6)), int(rng.integers(1, 4)), int(rng.integers(1, 9))
    source = np.arange(count) * length
    target = 5 + np.arange(count) * step
    if seed % 2:  # one run out of line: several series
        target[-1] += 1
    runs = Runs(source, target, np.full(count, length))
    greedy = _greedy_series(runs, max_step=8)
    whole = _as_one_series(runs, max_step=8)
    assert (whole is not None) == (len(greedy) == 1)
    if whole is not None:
        assert [whole] == greedy
