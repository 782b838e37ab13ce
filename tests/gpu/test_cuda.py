"""What needs a GPU: tensors read on one and handed back to the host (these skip on a machine
without CUDA; the engine tests run on a GPU too, as they are)."""

from __future__ import annotations

import os

import pytest
import torch

from vlens.runtime.steps.kept_steps import KeptSteps, Segment
from vlens.runtime.transfer import shared_tensors
from vlens.runtime.transfer.messages import PaddedRows

KEEP_X = frozenset({"x"})


def rows(*values: float) -> torch.Tensor:
    return torch.tensor(values).reshape(-1, 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_rows_read_on_a_gpu_come_back_where_asked(device):
    store = KeptSteps()
    store.add("x", [Segment("a", 2, 0), Segment("b", 1, 0)], rows(1, 2, 3).cuda())
    store.add("x", [Segment("b", 1, 1)], rows(4).cuda())
    taken = store.take(["a", "b"], {"a": KEEP_X, "b": KEEP_X}, device)["x"]
    assert taken.values.device.type == device
    assert taken.values.is_pinned() == (device == "cpu")  # one transfer, into pinned memory
    assert taken.values.squeeze(-1).tolist() == [[1, 2], [3, 4]]


def _hand_back_on_gpu(connection) -> None:
    """A worker's side: tensors on its GPU, pickled for a reader on this machine; it stays
    alive until the reader has copied them (as a vLLM worker does)."""
    generator = torch.Generator().manual_seed(3)
    value = {"rows": PaddedRows(torch.randn(300, 64, generator=generator).cuda(), [[(0, 300)]]),
             "bf16": torch.randn(4, 1 << 18, generator=generator).to(torch.bfloat16).cuda()[1:3]}
    connection.send(shared_tensors.dumps(value, "test-4", shared_tensors.this_machine()))
    connection.recv()
    del value
    shared_tensors.collect_handed_back()
    connection.send(torch.cuda.memory_allocated())


# Not torch.cuda.is_available(): asking the driver at collection would make vLLM's later forked
# workers (other test files) fail to start CUDA.
@pytest.mark.skipif(torch.version.cuda is None or not os.path.exists("/dev/nvidiactl"),
                    reason="CUDA IPC needs a GPU")
def test_tensors_on_a_workers_gpu_cross_as_handles_and_are_copied_to_the_host():
    import multiprocessing

    generator = torch.Generator().manual_seed(3)
    rows = torch.randn(300, 64, generator=generator)
    bf16 = torch.randn(4, 1 << 18, generator=generator).to(torch.bfloat16)[1:3]
    ours, theirs = multiprocessing.get_context("spawn").Pipe()
    worker = multiprocessing.get_context("spawn").Process(target=_hand_back_on_gpu, args=(theirs,))
    worker.start()
    try:
        payload = ours.recv()
        assert len(payload) < 10_000  # handles, not values
        back = shared_tensors.loads([payload])[0]
        assert back["rows"].values.device.type == "cpu" and back["rows"].values.is_pinned()
        assert torch.equal(back["rows"].values, rows) and back["rows"].spans == [[(0, 300)]]
        assert back["bf16"].dtype == torch.bfloat16 and torch.equal(back["bf16"], bf16)
        ours.send("copied")
        assert ours.recv() == 0  # the worker freed its memory once this process let go of it
    finally:
        worker.join(timeout=60)
    assert worker.exitcode == 0
