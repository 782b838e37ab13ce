"""Worker results whose large tensors cross through shared-memory files."""

from __future__ import annotations

import glob
import os

import cloudpickle
import pytest
import torch

from vlens import Steer
from vlens.runtime.transfer import shared_tensors
from vlens.runtime.transfer.messages import PaddedRows


def _leftover_files() -> set[str]:
    return set(glob.glob(os.path.join(shared_tensors.SHARED_MEMORY, "vlens-rows-*")))


def test_large_tensors_round_trip_through_files_that_are_removed():
    before = _leftover_files()
    large = torch.randn(640, 7, 128).to(torch.bfloat16)  # 1,146,880 bytes
    large32 = torch.randn(2048, 160)
    small = torch.arange(12).view(3, 4)
    strided = torch.randn(512, 1024)[:, ::2]  # not contiguous
    value = {"rows": PaddedRows(large32, [[(0, 2048)]]), "small": small, "strided": strided,
             "bf16": large, "text": "kept"}
    payload = shared_tensors.dumps(value, "test-1", shared_tensors.this_machine())
    assert len(payload) < 100_000  # the large tensors are not in the pickle
    back = shared_tensors.loads([payload])[0]
    assert torch.equal(back["rows"].values, large32) and back["rows"].spans == [[(0, 2048)]]
    assert torch.equal(back["small"], small)
    assert torch.equal(back["strided"], strided)
    assert back["bf16"].dtype == torch.bfloat16 and torch.equal(back["bf16"], large)
    assert back["text"] == "kept"
    assert _leftover_files() == before
    back["rows"].values[0, 0] = 7.0  # the mapping is private and writable
    assert back["rows"].values[0, 0] == 7.0 and large32[0, 0] != 7.0


def test_files_a_call_left_unread_are_removed():
    before = _leftover_files()
    shared_tensors.dumps(torch.zeros(1 << 20), "test-2", shared_tensors.this_machine())  # unread
    assert len(_leftover_files() - before) == 1
    shared_tensors.remove_unread("test-2")
    assert _leftover_files() == before


def test_a_reader_on_another_machine_gets_the_tensors_in_the_pickle():
    before = _leftover_files()
    value = torch.randn(1 << 19)
    payload = shared_tensors.dumps(value, "test-3", "another-host/boot")
    assert len(payload) > value.numel() * 4 and _leftover_files() == before
    assert torch.equal(shared_tensors.loads([payload])[0], value)


SMALL_TENSORS = [
    torch.randn(3, 4),
    torch.randn(4, 3).t(),  # not contiguous
    torch.tensor(2.5),  # no dimensions
    torch.zeros(0, 5),
    torch.randn(5).to(torch.bfloat16),  # no numpy dtype of its own
    torch.tensor([True, False]),
    torch.arange(10)[2:7],  # a view into a larger storage
    torch.randn(3, dtype=torch.complex64).conj(),
]


@pytest.mark.parametrize("tensor", SMALL_TENSORS, ids=lambda t: f"{t.dtype}{tuple(t.shape)}")
def test_small_tensors_cross_as_their_bytes_in_arguments_and_results(tensor):
    arguments = cloudpickle.loads(shared_tensors.dumps_arguments((tensor, lambda: tensor)))
    result = shared_tensors.loads(
        [shared_tensors.dumps(tensor, "test-4", shared_tensors.this_machine())]
    )[0]
    for back in (arguments[0], arguments[1](), result):
        assert back.dtype == tensor.dtype and back.shape == tensor.shape
        assert torch.equal(back, tensor.resolve_conj())
    steer = cloudpickle.loads(shared_tensors.dumps_arguments(Steer("x", add=torch.ones(4))))
    assert torch.equal(steer.add, torch.ones(4))


def test_a_small_view_carries_only_its_own_bytes():
    large = torch.randn(1 << 16)
    assert len(shared_tensors.dumps_arguments(large[:4])) < 1000


def test_tensors_that_need_autograd_or_a_subclass_are_pickled_as_torch_does():
    parameter = torch.nn.Parameter(torch.ones(2))
    needs_grad = torch.ones(3, requires_grad=True)
    back_parameter, back_needs_grad = cloudpickle.loads(
        shared_tensors.dumps_arguments((parameter, needs_grad))
    )
    assert isinstance(back_parameter, torch.nn.Parameter) and back_needs_grad.requires_grad
