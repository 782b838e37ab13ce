"""How much each way of moving a step's kept rows to the host slows the GPU's work (CUDA only).

A stand-in for a compiled generation that keeps every layer: each step runs matmuls sized like
one step of the Qwen3-8B-shape benchmark (``--step-ms``), and produces ``--names`` tensors of
``rows x d_model`` bf16 rows whose copies go to ``[batch * width, d_model]`` host tensors at each
request's position. Reported side by side in one run, as the ratio of the plain steps' time to
the steps' time with the copy (and the copy's wait at the end):

- ``device``: rows cloned on the GPU only (the cache on the GPU);
- ``uva``: rows cloned, then a side stream scatters them into pinned host tensors through the
  GPU's view of them (unified addressing; the SMs write over PCIe);
- ``dma``: rows cloned, a side stream copies them (copy engines, no SM) into a bounded ring of
  pinned staging blocks, and host threads scatter each block into the final host tensors
  (``dma_pinned``: pinned, allocated once and reused; ``dma_pageable``: ordinary memory,
  allocated for each call as a user's cache is).

Usage: ``python bench/host_copy.py [--shape decode|prefill]``
"""

from __future__ import annotations

import argparse
import queue
import threading
import time
from collections import deque

import torch


def make_compute(step_ms: float, device: torch.device):
    """A function running about ``step_ms`` of bf16 matmuls, and the rows it produces."""
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    out = torch.empty_like(a)
    for _ in range(3):
        torch.matmul(a, b, out=out)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(20):
        torch.matmul(a, b, out=out)
    torch.cuda.synchronize()
    per = (time.perf_counter() - start) / 20 * 1000
    repeats = max(1, round(step_ms / per))

    def compute() -> torch.Tensor:
        for _ in range(repeats):
            torch.matmul(a, b, out=out)
        return out

    return compute


def targets_for(step: int, shape: str, batch: int, width: int, rows: int) -> torch.Tensor:
    if shape == "decode":  # one row per request, at its position
        return torch.arange(batch) * width + (width // 2 + step)
    per = rows // batch  # prefill: each request's positions in a row
    first = (step * per) % width
    return (torch.arange(batch)[:, None] * width + first + torch.arange(per)[None, :]).reshape(-1)


class DmaHost:
    """Side-stream copies into a ring of pinned blocks; host threads scatter the blocks."""

    def __init__(self, blocks: int, block_bytes: int, device, threads: int) -> None:
        self.free: queue.Queue = queue.Queue()
        for _ in range(blocks):
            self.free.put(torch.empty(block_bytes, dtype=torch.uint8, pin_memory=True))
        self.side = torch.cuda.Stream(device)
        self.work: queue.Queue = queue.Queue()
        for _ in range(threads):
            threading.Thread(target=self._run, daemon=True).start()
        self.pending = 0
        self.done = threading.Semaphore(0)

    def _run(self) -> None:
        while True:
            event, block, staged, final, targets = self.work.get()
            event.synchronize()
            final.index_copy_(0, targets, staged)
            self.free.put(block)
            self.done.release()

    def write(self, rows: torch.Tensor, final: torch.Tensor, targets: torch.Tensor) -> None:
        block = self.free.get()
        staged = block[: rows.numel() * rows.element_size()].view(rows.dtype).view(rows.shape)
        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side):
            staged.copy_(rows, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.side)
        rows.record_stream(self.side)
        self.pending += 1
        self.work.put((event, block, staged, final, targets))

    def drain(self) -> None:
        for _ in range(self.pending):
            self.done.acquire()
        self.pending = 0


def run(way: str, args, compute, finals, view, dma: DmaHost | None) -> float:
    device = torch.device("cuda")
    steps = args.steps
    rows = args.rows
    in_flight: deque = deque()
    side = torch.cuda.Stream(device)
    device_cache = None
    if way == "device":
        device_cache = [torch.empty(steps * rows, args.d_model, dtype=torch.bfloat16,
                                    device=device) for _ in range(args.names)]
    if way == "dma_pageable":
        finals = [torch.empty_like(final) for final in finals]
    torch.cuda.synchronize()
    start = time.perf_counter()
    for step in range(steps):
        out = compute()
        targets = targets_for(step, args.shape, args.batch, args.width, rows)
        if way == "none":
            continue
        if way == "uva":
            on_gpu = targets.pin_memory().to(device, non_blocking=True)
            event = torch.cuda.Event()
            held = [on_gpu]
        for name in range(args.names):
            source = out[:rows] if rows <= out.shape[0] else out.repeat(rows // out.shape[0], 1)
            if way == "device":
                device_cache[name][step * rows:(step + 1) * rows].copy_(source)
                continue
            clone = source.clone()
            if way == "uva":
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    view[name].index_copy_(0, on_gpu, clone)
                held.append(clone)
            else:
                dma.write(clone, finals[name], targets)
        if way == "uva":
            event.record(side)
            in_flight.append((event, held))
            while len(in_flight) > 4:
                in_flight.popleft()[0].synchronize()
    torch.cuda.synchronize()
    if way == "uva":
        side.synchronize()
    if dma is not None:
        dma.drain()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=["decode", "prefill"], default="decode")
    parser.add_argument("--names", type=int, default=36)
    parser.add_argument("--d-model", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--step-ms", type=float, default=0.0)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--reps", type=int, default=2)
    args = parser.parse_args()
    if args.shape == "decode":
        args.steps, args.rows, args.width = 128, args.batch, 256
        args.step_ms = args.step_ms or 2156 / 128 * 0.95
    else:
        args.steps, args.rows, args.width = 4, args.batch * 32, 128
        args.step_ms = args.step_ms or 765 / 4 * 0.95
    from vllm.platforms import current_platform

    current_platform.import_kernels()  # registers torch.ops._C.get_cuda_view_from_cpu_tensor

    device = torch.device("cuda")
    compute = make_compute(args.step_ms, device)
    shape = (args.batch * args.width + 1, args.d_model)
    start = time.perf_counter()
    finals = [torch.empty(shape, dtype=torch.bfloat16, pin_memory=True)
              for _ in range(args.names)]
    pin_s = time.perf_counter() - start
    view = [torch.ops._C.get_cuda_view_from_cpu_tensor(final) for final in finals]
    block_bytes = args.rows * args.d_model * 2
    dma = DmaHost(max(8, 2 * args.names), block_bytes, device, args.threads)
    gib = args.names * args.steps * args.rows * args.d_model * 2 / 2**30
    print(f"[host_copy] {args.shape}: {args.steps} steps of ~{args.step_ms:.1f} ms, {args.names}"
          f" names x {args.rows} rows, {gib:.1f} GiB; pinning the finals"
          f" took {pin_s:.2f} s; host threads {args.threads}")
    best: dict[str, float] = {}
    for _ in range(args.reps):
        for way in ["none", "device", "uva", "dma_pinned", "dma_pageable"]:
            seconds = run(way, args, compute, finals, view,
                          dma if way.startswith("dma") else None)
            best[way] = min(best.get(way, seconds), seconds)
    for way, seconds in best.items():
        print(f"| {args.shape} | {way} | {seconds:.3f} s | {best['none'] / seconds:.3f} |")


if __name__ == "__main__":
    main()
