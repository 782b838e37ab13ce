"""Host memory a worker process fills and the user's process maps: kept rows handed back uncopied.

Under tensor parallelism (or any engine whose workers are processes of their own) the compiled engine
writes a call's kept rows into host memory as steps end (:mod:`vlens.runtime.transfer.host_stream`), as it
does on one rank in the user's own process. That memory must then be readable by the user's
process without a copy (an every-layer generation of an 8B model is 9 GiB per rank), and on a GPU
it must be registered with CUDA (page-locked) for the copy engines to fill it while steps run,
which costs about a second per GiB the first time. So a worker takes its memory from a pool of
:class:`HostBlock`: anonymous shared-memory files (``memfd``), mapped and registered once,
reused call after call. A block handed back crosses as its owner's process id, file descriptor and
the tensor's place in it; the user's process opens the file through ``/proc/<pid>/fd`` and maps
it (once: the mapping is kept for the block's next calls, see :class:`_Mapped`), and the user's
cache is views of that mapping.

A block is reused only when the user's process has let go of it. Its first page holds one byte of
state: the worker sets it to :data:`HANDED_OUT` when it pickles a reference to the block, and the
user's process sets it back to :data:`FREE` when the last tensor of that call viewing the block
dies (a finalizer on the buffer object, one per call, that the tensors hold). Until then the pool
takes another block. The files have no name, so nothing outlives the processes that hold them.
"""

from __future__ import annotations

import mmap
import os
import weakref
from dataclasses import dataclass

import torch
from torch import Tensor

#: The page before the data: its first byte is the block's state.
HEADER_BYTES = mmap.PAGESIZE
FREE, HANDED_OUT = 0, 1

#: A block no call of the last this many took is given back to the system (a user who holds
#: each cache until the next call returns uses two sets of blocks in turn).
IDLE_CALLS = 2

#: A reference to a block's tensor as pickled: the owner's pid, the block's fd and size, the
#: tensor's byte offset from the block's data, dtype name, shape and stride.
BlockReference = tuple[int, int, int, int, str, tuple[int, ...], tuple[int, ...]]


@dataclass(eq=False)
class HostBlock:
    """``size`` bytes of shared memory after a header page, the file ``fd``, mapped in this (a
    worker's) process."""

    fd: int
    size: int
    mapping: mmap.mmap
    data: Tensor  # the ``size`` bytes after the header, as uint8
    registered: bool  # page-locked for CUDA
    in_call: bool = True  # a call of this worker writes or holds it
    last_call: int = 0  # the pool's count of calls when one last took it

    def __post_init__(self) -> None:
        self._close = weakref.finalize(self, os.close, self.fd)

    def user_holds(self) -> bool:
        return self.mapping[0] == HANDED_OUT

    def view(self, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        nbytes = int(torch.Size(shape).numel()) * dtype.itemsize
        return self.data[:nbytes].view(dtype).view(shape)

    def discard(self) -> None:
        """Unlock its pages and close its file; the memory goes with the last view of it."""
        if self.registered:
            torch.cuda.cudart().cudaHostUnregister(self.data.data_ptr() - HEADER_BYTES)
            self.registered = False
        self._close()


class HostBlockPool:
    """The blocks of one worker process (see the module's docstring)."""

    def __init__(self) -> None:
        self.blocks: list[HostBlock] = []
        self.calls = 0  # calls ended

    def take(self, shape: tuple[int, ...], dtype: torch.dtype, register: bool) -> Tensor:
        """A ``shape`` tensor of ``dtype`` in a block no call and no user holds (registered with
        CUDA when ``register``), the smallest that fits; a new block where none does."""
        nbytes = int(torch.Size(shape).numel()) * dtype.itemsize
        unused = [block for block in self.blocks if not block.in_call and not block.user_holds()]
        fitting = [b for b in unused if b.size >= nbytes and (b.registered or not register)]
        if fitting:
            block = min(fitting, key=lambda b: b.size)
            block.in_call = True
            unused.remove(block)
        else:
            block = _new_block(nbytes, register)
            self.blocks.append(block)
        block.last_call = self.calls
        for idle in unused:
            if self.calls - idle.last_call > IDLE_CALLS:
                self.blocks.remove(idle)
                idle.discard()
        return block.view(shape, dtype)

    def end_call(self, tensors: list[Tensor]) -> None:
        """The call that took ``tensors`` ended: their blocks are the user's or free."""
        self.calls += 1
        for tensor in tensors:
            block = self.block_of(tensor)
            if block is not None:
                block.in_call = False

    def block_of(self, tensor: Tensor) -> HostBlock | None:
        """The block ``tensor``'s memory lies in, if any."""
        if tensor.device.type != "cpu":
            return None
        start = tensor.untyped_storage().data_ptr()
        for block in self.blocks:
            base = block.data.data_ptr()
            if base <= start < base + block.size:
                return block
        return None

    def hand_out(self, tensor: Tensor) -> BlockReference | None:
        """What the user's process needs to map ``tensor`` (:func:`open_reference`), where it
        lies in a block; the block is the user's until the last tensor viewing it dies there."""
        block = self.block_of(tensor)
        if block is None:
            return None
        block.mapping[0] = HANDED_OUT
        offset = tensor.data_ptr() - block.data.data_ptr()
        dtype = str(tensor.dtype).removeprefix("torch.")
        return (os.getpid(), block.fd, block.size, offset, dtype, tuple(tensor.shape),
                tuple(tensor.stride()))


_pool: HostBlockPool | None = None


def pool() -> HostBlockPool:
    """This process's pool."""
    global _pool
    if _pool is None:
        _pool = HostBlockPool()
    return _pool


def hand_out(tensor: Tensor) -> BlockReference | None:
    """:meth:`HostBlockPool.hand_out` in a process that has a pool, else None."""
    return None if _pool is None else _pool.hand_out(tensor)


def _new_block(nbytes: int, register: bool) -> HostBlock:
    size = -(-max(nbytes, 1) // mmap.PAGESIZE) * mmap.PAGESIZE
    fd = os.memfd_create("vlens-kept-rows", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, HEADER_BYTES + size)
        mapping = mmap.mmap(fd, HEADER_BYTES + size)
    except BaseException:
        os.close(fd)
        raise
    _advise_huge_pages(mapping)
    with torch.inference_mode(False):  # the user's cache, not an inference tensor
        data = torch.frombuffer(mapping, dtype=torch.uint8, offset=HEADER_BYTES, count=size)
    if register:
        error = int(torch.cuda.cudart().cudaHostRegister(data.data_ptr() - HEADER_BYTES,
                                                         HEADER_BYTES + size, 0))
        if error != 0:
            del data
            mapping.close()
            os.close(fd)
            raise RuntimeError(f"page-locking {size} bytes of shared host memory for CUDA "
                               f"failed: CUDA error {error}")
    return HostBlock(fd, size, mapping, data, register)


def _advise_huge_pages(mapping: mmap.mmap) -> None:
    """Ask for huge pages where the system gives them to shared memory (fewer page faults)."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        try:
            mapping.madvise(advice)
        except OSError:
            pass


# ---- in the user's process -------------------------------------------------------------------


@dataclass(eq=False)
class _Mapped:
    """A worker's block mapped here, kept from call to call: the pages this process has touched
    stay mapped, so reading the next call's cache in that block costs no page faults."""

    inode: int
    fd: int  # to write the block's state
    mapping: mmap.mmap

    def __post_init__(self) -> None:
        weakref.finalize(self, os.close, self.fd)


#: (worker pid, its fd) -> the block mapped here
_mapped: dict[tuple[int, int], _Mapped] = {}


def open_reference(reference: BlockReference, leases: dict[tuple[int, int], Tensor]) -> Tensor:
    """The tensor a worker handed out as ``reference`` (:meth:`HostBlockPool.hand_out`), a view
    of its block mapped here; ``leases`` shares one lease of a block among one result's
    references. The block goes back to the worker's pool when the last view of the lease dies."""
    pid, fd, size, offset, dtype_name, shape, stride = reference
    key = (pid, fd)
    if key not in leases:
        block = _mapping_of(pid, fd, size)
        lease = memoryview(block.mapping)  # what the views hold: its end frees the block
        weakref.finalize(lease, _give_back, block, os.getpid())
        with torch.inference_mode(False):
            leases[key] = torch.frombuffer(lease, dtype=torch.uint8, offset=HEADER_BYTES,
                                           count=size)
    dtype = getattr(torch, dtype_name)
    extent = elements_spanned(shape, stride)
    typed = leases[key][offset : offset + extent * dtype.itemsize].view(dtype)
    return typed.as_strided(shape, stride)


def elements_spanned(shape: tuple[int, ...], stride: tuple[int, ...]) -> int:
    """How many elements of its storage a tensor of ``shape`` and (non-negative) ``stride``
    spans, from its first element to its last."""
    return 0 if 0 in shape else 1 + sum((n - 1) * step for n, step in zip(shape, stride))


def forget_stale() -> None:
    """Unmap the blocks whose worker has given them back or has ended (their memory goes once
    no cache views them)."""
    for key, block in list(_mapped.items()):
        if _inode(*key) != block.inode:
            del _mapped[key]


def _mapping_of(pid: int, fd: int, size: int) -> _Mapped:
    forget_stale()
    block = _mapped.get((pid, fd))
    if block is None or len(block.mapping) != HEADER_BYTES + size:
        path = f"/proc/{pid}/fd/{fd}"
        own = os.open(path, os.O_RDWR)
        try:
            mapping = mmap.mmap(own, HEADER_BYTES + size)
        except BaseException:
            os.close(own)
            raise
        _advise_huge_pages(mapping)
        block = _mapped[(pid, fd)] = _Mapped(os.fstat(own).st_ino, own, mapping)
    return block


def _inode(pid: int, fd: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}/fd/{fd}").st_ino
    except OSError:
        return None


def _give_back(block: _Mapped, owner: int) -> None:
    """Mark a block :data:`FREE` for its worker's pool, from the process that took the lease
    (not from a forked child dropping its copy, while the parent still reads the cache)."""
    if os.getpid() == owner:
        os.pwrite(block.fd, bytes([FREE]), 0)
