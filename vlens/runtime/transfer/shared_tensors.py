"""Results of worker processes whose tensors cross through shared-memory files, not pickles.

Under tensor parallelism vLLM's workers are processes of their own, and what a worker returns
reaches the user's process pickled through vLLM's message queue. A capture's kept rows are large
(one layer of a 256-prompt generation of an 8B model is half a gigabyte), and a pickled tensor is
copied several times on the way (serialised, sent, received, rebuilt). Instead each large tensor is
copied once into a file in ``/dev/shm`` (memory, not disk), and only its path, dtype and shape are
pickled; the user's process maps the file as the tensor's storage (no copy) and removes its name at
once, so the memory is freed with the tensor. A worker on another machine (a Ray cluster's node)
pickles its tensors whole: the files would not be there. Files are named after the call that made
them, and the user's process removes what a call left unread (a rank failed, so no result was
read) when it ends: no file outlives its call.

Smaller CPU tensors, in results and in the arguments the user's process sends (a steering
vector per request), cross as their bytes in a numpy array (:func:`rebuilt_tensor`): torch's own
pickling of a tensor writes its whole storage through ``torch.save``, ~40 µs a tensor and all of
a large storage for a small view of it; an array pickles ten times faster.

Tensors that already lie in shared host memory (a call's kept rows, written there as steps ended:
:mod:`vlens.runtime.transfer.host_blocks`) cross as a reference to that memory, which the user's process
maps, with no copy at all.

Tensors a worker hands back on its GPU (``finish`` with ``device="cuda"``, see
``Engine.finish``) cross as CUDA IPC handles instead: the user's process opens the worker's
memory and copies it once to the host (into pinned memory, which torch reuses from call to
call), with no copy through files; the worker frees its memory once the user's
process has let go of it (:func:`collect_handed_back`).
"""

from __future__ import annotations

import contextlib
import functools
import glob
import io
import os
import pickle
import shutil
import socket
import tempfile
import uuid
from collections.abc import Sequence
from typing import Any

import cloudpickle
import numpy as np
import torch
from torch import Tensor
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from vlens.runtime.transfer import host_blocks

MIN_SHARED_BYTES = 1 << 20

#: Where the files are made: memory-backed where the machine has it.
SHARED_MEMORY = "/dev/shm"

_PREFIX = "vlens-rows-"


@functools.cache
def this_machine() -> str:
    """What tells a machine (and a container, which has a /dev/shm of its own) from another."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot:
            boot_id = boot.read().strip()
    except OSError:
        boot_id = ""
    return f"{socket.gethostname()}/{boot_id}"


def dumps(value: Any, call: str, reader_machine: str) -> bytes:
    """``value`` pickled; its large CPU tensors written to shared-memory files named after
    ``call`` (a label unique to one call of the workers, see :func:`remove_unread`) when the
    reader runs on this machine (:func:`this_machine`), else pickled whole."""
    buffer = io.BytesIO()
    if reader_machine == this_machine():
        _SharingPickler(buffer, call).dump(value)
    else:
        _ArrayPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    return buffer.getvalue()


def dumps_arguments(args: Any) -> bytes:
    """The arguments of a call of the workers, cloudpickled (user hook functions are often
    closures), their CPU tensors as arrays."""
    buffer = io.BytesIO()
    _ArgumentPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(args)
    return buffer.getvalue()


def rebuilt_tensor(raw: np.ndarray, dtype_name: str, shape: tuple[int, ...]) -> Tensor:
    """A tensor from its bytes (:func:`_as_array`)."""
    return torch.from_numpy(raw).view(getattr(torch, dtype_name)).reshape(shape)


def _as_array(obj: Any) -> Any:
    """A plain CPU tensor reduced to its bytes as a numpy array (which pickles fast, of any
    dtype), or ``NotImplemented`` for anything else (pickled as usual)."""
    if type(obj) is not Tensor or obj.device.type != "cpu" or obj.layout != torch.strided:
        return NotImplemented
    if obj.requires_grad or obj.is_quantized:
        return NotImplemented
    dtype_name = str(obj.dtype).removeprefix("torch.")
    return rebuilt_tensor, (_raw_bytes(obj), dtype_name, tuple(obj.shape))


def _raw_bytes(obj: Tensor) -> np.ndarray:
    """A CPU tensor's values as a flat numpy array of their bytes (any dtype, numpy's or not)."""
    plain = obj.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
    return plain.view(torch.uint8).numpy()


class _ArrayPickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        return _as_array(obj)


class _ArgumentPickler(cloudpickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        reduced = _as_array(obj)
        return super().reducer_override(obj) if reduced is NotImplemented else reduced


def loads(payloads: Sequence[bytes]) -> list[Any]:
    """The values :func:`dumps` pickled (one per rank), their tensors mapped from their files
    (which are removed); tensors that crossed as CUDA handles are copied to the host, the
    copies out of every rank's GPU running together, waited for once."""
    opened: list[Tensor] = []
    values = []
    for payload in payloads:
        unpickler = _MappingUnpickler(io.BytesIO(payload), opened)
        values.append(unpickler.load())
    for device in {tensor.device for tensor in opened}:
        torch.cuda.synchronize(device)  # the copies out of the workers' memory, then let go
    return values


def collect_handed_back() -> None:
    """In a worker: free the GPU memory of tensors handed back as CUDA handles that the user's
    process has let go of (torch keeps it until then, and frees it only when asked)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.ipc_collect()


def remove_written() -> None:
    """Remove every file this process wrote that no reader took (its reader is gone)."""
    for path in list(_written):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    _written.clear()


def remove_unread(call: str) -> None:
    """Remove the files of ``call`` that no :func:`loads` took (after a call some rank failed)."""
    for folder in {SHARED_MEMORY, tempfile.gettempdir()}:
        for path in glob.glob(os.path.join(folder, f"{_PREFIX}{call}-*")):
            os.unlink(path)


class _SharingPickler(_ArrayPickler):
    """Large tensors by reference (:meth:`persistent_id`, asked first), others as arrays."""

    def __init__(self, file: io.BytesIO, call: str) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.call = call

    def persistent_id(self, obj: Any) -> tuple | None:
        if isinstance(obj, Tensor) and obj.is_cuda:
            _, handle = reduce_tensor(obj)  # its storage's IPC handle, offsets, and an event
            return ("cuda-tensor", handle)
        if not isinstance(obj, Tensor) or obj.device.type != "cpu":
            return None
        reference = host_blocks.hand_out(obj)
        if reference is not None:
            return ("host-block", reference)
        nbytes = obj.numel() * obj.element_size()
        if nbytes < MIN_SHARED_BYTES or obj.requires_grad:
            return None
        path = os.path.join(_folder_for(nbytes), f"{_PREFIX}{self.call}-{uuid.uuid4().hex}")
        # Written, not mapped and copied into: torch would copy on all its threads, each
        # faulting in pages of the new file (a server's engine process hands back one capture
        # per request)
        with open(path, "wb") as file:
            file.write(memoryview(_raw_bytes(obj)))
        _forget_read()
        _written.add(path)
        return ("shared-tensor", path, str(obj.dtype).removeprefix("torch."), tuple(obj.shape))


class _MappingUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, opened: list[Tensor]) -> None:
        super().__init__(file)
        #: tensors opened in a worker's GPU memory, held until their copies are done
        self.opened = opened
        #: this result's lease of each worker's host block it views (:mod:`host_blocks`)
        self.leases: dict[tuple[int, int], Tensor] = {}

    def persistent_load(self, pid: Any) -> Tensor:
        if pid[0] == "cuda-tensor":
            return self._copied_out(rebuild_cuda_tensor(*pid[1]))
        if pid[0] == "host-block":
            return host_blocks.open_reference(pid[1], self.leases)
        kind, path, dtype_name, shape = pid
        if kind != "shared-tensor":
            raise pickle.UnpicklingError(f"unknown persistent id {kind!r}")
        dtype = getattr(torch, dtype_name)
        count = int(torch.Size(shape).numel())
        try:
            # Private: the pages are the file's until written; writes stay in this process.
            mapped = torch.from_file(path, shared=False, size=count, dtype=dtype)
        finally:
            os.unlink(path)
        return mapped.view(shape)

    def _copied_out(self, opened: Tensor) -> Tensor:
        """A host copy of the worker's ``opened`` tensor, through pinned memory, without
        waiting (:func:`loads` waits once for all)."""
        self.opened.append(opened)
        host = torch.empty(opened.shape, dtype=opened.dtype, pin_memory=True)
        return host.copy_(opened, non_blocking=True)


#: The files this process wrote for a reader: the reader removes each once it has mapped it.
_written: set[str] = set()


def _forget_read() -> None:
    """Drop the files a reader has removed from :data:`_written` (it only grows as calls go)."""
    if len(_written) > 64:
        _written.intersection_update(path for path in _written if os.path.exists(path))


def _folder_for(nbytes: int) -> str:
    """Shared memory when it has room for ``nbytes`` (containers often give it 64 MiB), else the
    temporary folder."""
    if os.path.isdir(SHARED_MEMORY) and shutil.disk_usage(SHARED_MEMORY).free > 2 * nbytes:
        return SHARED_MEMORY
    return tempfile.gettempdir()
