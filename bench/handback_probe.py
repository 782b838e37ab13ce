"""What the hand-back of kept rows from another process's GPU costs, piece by piece (the
tensor-parallel path of ``vlens.runtime.transfer.shared_tensors``): a worker process allocates ``--names``
tensors of ``--mib`` MiB each on its GPU and passes them as CUDA IPC handles; this process opens
them and copies each to pinned host memory, as vlens's ``loads`` does.

    python bench/handback_probe.py --names 18 --mib 535     # one rank's every-layer share

Prints, per repetition, the seconds to open the handles, to copy the rows out (and the rate),
and, for comparison, the same copy of a tensor of this process's own.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.multiprocessing as mp


def worker(names: int, mib: int, reps: int, out: mp.Queue, done: mp.Event) -> None:
    for _ in range(reps):
        tensors = [torch.full((mib << 19,), float(i), dtype=torch.bfloat16, device="cuda")
                   for i in range(names)]
        torch.cuda.synchronize()
        out.put(tensors)
        done.wait()
        done.clear()
        del tensors
        torch.cuda.ipc_collect()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--names", type=int, default=18)
    parser.add_argument("--mib", type=int, default=535)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    context = mp.get_context("spawn")
    queue, done = context.Queue(), context.Event()
    child = context.Process(target=worker, args=(args.names, args.mib, args.reps, queue, done))
    child.start()
    total = args.names * args.mib / 1024
    for rep in range(args.reps):
        start = time.perf_counter()
        opened = queue.get()
        torch.cuda.synchronize()
        open_s = time.perf_counter() - start
        start = time.perf_counter()
        hosts = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in opened]
        pin_s = time.perf_counter() - start
        start = time.perf_counter()
        for host, tensor in zip(hosts, opened, strict=True):
            host.copy_(tensor, non_blocking=True)
        torch.cuda.synchronize()
        copy_s = time.perf_counter() - start
        assert all(float(h[-1]) == i for i, h in enumerate(hosts))
        print(f"rep {rep}: {args.names} x {args.mib} MiB ({total:.1f} GiB): open {open_s:.3f} s, "
              f"pinned buffers {pin_s:.3f} s, copy {copy_s:.3f} s ({total / copy_s:.1f} GiB/s)",
              flush=True)
        del opened, hosts
        done.set()
    child.join()
    own = torch.empty(args.names * (args.mib << 19), dtype=torch.bfloat16, device="cuda")
    host = torch.empty(own.shape, dtype=own.dtype, pin_memory=True)
    for rep in range(2):
        start = time.perf_counter()
        host.copy_(own, non_blocking=True)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        print(f"own tensor, rep {rep}: copy {seconds:.3f} s ({total / seconds:.1f} GiB/s)")


if __name__ == "__main__":
    main()
