"""The shared host memory a worker's kept rows are written into and the user's process maps
(:mod:`vlens.runtime.transfer.host_blocks`), in one process: the pool's worker side and the user's side
of one block are two mappings of one file, as they are across processes."""

import gc
import os

import pytest
import torch

from vlens.runtime.transfer import host_blocks
from vlens.runtime.transfer.host_blocks import HostBlockPool, open_reference


def one_call(pool: HostBlockPool, count: int, value: float) -> torch.Tensor:
    """A worker's call: ``count`` floats in a block, filled with ``value``, then the call ends."""
    host = pool.take((count,), torch.float32, register=False)
    host.fill_(value)
    pool.end_call([host])
    return host


def handed_back(pool: HostBlockPool, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as the user's process would see it after the call that filled it."""
    reference = pool.hand_out(tensor)
    assert reference is not None
    return open_reference(reference, {})


def test_a_view_crosses_with_its_offset_shape_and_stride():
    pool = HostBlockPool()
    host = pool.take((3, 5, 4), torch.float32, register=False)
    host.copy_(torch.arange(60.0).view(3, 5, 4))
    pool.end_call([host])
    view = host[1, :, 1:3]  # an offset into the block, and strides that skip
    user = handed_back(pool, view)
    assert user.shape == view.shape and user.stride() == view.stride()
    assert torch.equal(user, view)
    host[1, 0, 1] = -1.0  # one memory: the user's view is the worker's
    assert user[0, 0] == -1.0


def test_a_block_the_user_holds_is_not_reused_until_let_go():
    pool = HostBlockPool()
    first = one_call(pool, 16, 1.0)
    user = handed_back(pool, first)
    second = pool.take((16,), torch.float32, register=False)  # the user still holds the first
    second.fill_(2.0)
    assert torch.equal(user, torch.ones(16))
    assert len(pool.blocks) == 2
    pool.end_call([second])
    del user
    gc.collect()
    third = pool.take((8,), torch.float32, register=False)  # fits in the first, let go of now
    assert len(pool.blocks) == 2
    assert pool.block_of(third) is pool.block_of(first)


def test_a_block_a_call_still_writes_is_not_taken_again():
    pool = HostBlockPool()
    first = pool.take((16,), torch.float32, register=False)
    second = pool.take((16,), torch.float32, register=False)
    assert pool.block_of(first) is not pool.block_of(second)


def test_blocks_no_recent_call_took_are_given_back():
    pool = HostBlockPool()
    held = [pool.take((1024,), torch.uint8, register=False) for _ in range(4)]
    pool.end_call(held)
    for _ in range(host_blocks.IDLE_CALLS):
        taken = pool.take((1 << 20,), torch.uint8, register=False)  # fits none of the four
        assert len(pool.blocks) == 5
        pool.end_call([taken])
    pool.take((1 << 20,), torch.uint8, register=False)
    assert len(pool.blocks) == 1


def test_tensors_outside_the_blocks_are_not_handed_out():
    pool = HostBlockPool()
    pool.take((4,), torch.float32, register=False)
    assert pool.hand_out(torch.zeros(4)) is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int64])
def test_every_dtype_crosses(dtype):
    pool = HostBlockPool()
    host = pool.take((2, 3), dtype, register=False)
    host.copy_(torch.arange(6).view(2, 3).to(dtype))
    pool.end_call([host])
    assert torch.equal(handed_back(pool, host), host)


def test_the_next_call_in_a_block_reuses_this_process_s_mapping():
    """Pages read once stay mapped here: the same block handed back again is the same mapping."""
    pool = HostBlockPool()
    first = handed_back(pool, one_call(pool, 64, 1.0))
    address = first.data_ptr()
    del first
    gc.collect()
    second = handed_back(pool, one_call(pool, 64, 2.0))
    assert second.data_ptr() == address and torch.equal(second, torch.full((64,), 2.0))


def test_a_block_given_back_by_its_worker_is_unmapped_here():
    pool = HostBlockPool()
    host = one_call(pool, 64, 0.0)
    block = pool.block_of(host)
    user = handed_back(pool, host)
    key = (os.getpid(), block.fd)
    assert key in host_blocks._mapped
    del user, host
    gc.collect()
    pool.blocks.remove(block)
    block.discard()
    host_blocks.forget_stale()
    assert key not in host_blocks._mapped


def test_a_forked_child_letting_go_of_a_cache_does_not_free_its_block():
    """A child forked while the cache is held (a DataLoader's workers) drops its copy: the block
    stays the parent's."""
    pool = HostBlockPool()
    host = one_call(pool, 16, 1.0)
    user = handed_back(pool, host)
    child = os.fork()
    if child == 0:  # the child: let go of its copy of the cache, then leave at once
        del user
        gc.collect()
        os._exit(0)
    os.waitpid(child, 0)
    assert pool.block_of(host).user_holds()
    del user
    gc.collect()
    assert not pool.block_of(host).user_holds()
