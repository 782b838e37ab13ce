"""``vlens cache`` on one engine against ``vlens cache --ray`` with 1 and N workers, side by side in
ONE run: the same prompts, names and settings, each a whole command (Ray's and the engines'
start-up included), as a user runs them.

    python bench/harvest.py                     # SmolLM2-135M, fp32, on this CPU: 1 engine, Ray 1 and 2
    python bench/harvest.py --preset gpu --workers 1 --prompts 4096 --block-prompts 512 \
        --batch-size 256 --names blocks.18.hook_resid_post     # H200: Qwen3-8B's shape, bf16

Each command runs twice, on a small and on a large prompt file (``--prompts`` and an eighth of
it), so that the fixed cost (Python, Ray, the engines' start) and the harvest's own throughput
come apart: *tokens/s* is the marginal rate, (rows of the large run - rows of the small run) /
(its time - the small run's). Each command is a process of its own that calls the Python API
(``write_activations`` on a ``HookedVLLM``; ``write_activations_on_ray``), so that the GPU preset's
engine arguments (dummy weights) reach every engine. The stores of every command must hold the same tokens; the rows of
a sample of prompts are compared (the same bytes where the batches are the same). Results go to
``--out`` (JSON), with the command and the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors import safe_open


def prompt_file(path: Path, prompts: int, tokens: int, vocab: int, seed: int) -> Path:
    """``prompts`` lines of ``tokens`` random ids each (token ids: no tokenizer differences)."""
    rng = random.Random(seed)
    lines = [json.dumps({"tokens": [rng.randrange(10, vocab) for _ in range(tokens)]})
             for _ in range(prompts)]
    path.write_text("\n".join(lines) + "\n")
    return path


def run(configuration: dict, log: Path, threads: int | None) -> float:
    """One command, a process of its own: :func:`child` with ``configuration``."""
    environment = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    command = [sys.executable, __file__, "--child", json.dumps(configuration)]
    started = time.perf_counter()
    with log.open("w") as output:
        subprocess.run(command, check=True, stdout=output, stderr=subprocess.STDOUT,
                       env=environment)
    return time.perf_counter() - started


def child(configuration: dict) -> None:
    from vlens.store.activations import write_activations
    from vlens.store.inputs import read_prompts
    from vlens.store.on_ray import Workers, write_activations_on_ray

    c = configuration
    if c["workers"] is None:
        from vlens import HookedVLLM

        model = HookedVLLM.from_pretrained(c["model"], dtype=c["dtype"], **c["engine"])
        write_activations(model, read_prompts(Path(c["prompts"])), c["names"], Path(c["out"]),
                          batch_size=c["batch_size"], dtype=c["dtype"], progress=False)
    else:
        write_activations_on_ray(
            c["model"], c["prompts"], c["names"], c["out"],
            workers=Workers(c["workers"], cpus=c["cpus_per_worker"]),
            block_prompts=c["block_prompts"], batch_size=c["batch_size"], dtype=c["dtype"],
            engine_args=c["engine"], progress=False)


def rows_of(out: Path) -> dict[int, dict[str, torch.Tensor]]:
    """A sample of prompts (every 37th) by their index in the file: their rows of every name."""
    parts = [out]
    if (out / "index.json").exists():
        index = json.loads((out / "index.json").read_text())
        parts = [out / f"block-{block['index']:05d}" for block in index["blocks"]]
    sample, number = {}, 0
    for part in parts:
        manifest = json.loads((part / "manifest.json").read_text())
        for prompt in manifest["prompts"]:
            if number % 37 == 0:
                shard = part / manifest["shards"][prompt["shard"]]["file"]
                with safe_open(shard, "pt") as opened:
                    sample[number] = {name: opened.get_slice(name)[prompt["start"]:prompt["stop"]]
                                      for name in manifest["names"]}
            number += 1
    return sample


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=["cpu", "gpu"], default="cpu",
                        help="cpu: the embedded SmolLM2; gpu: bench/run.py's GPU preset "
                        "(Qwen3-8B's shape, dummy weights, its engine arguments)")
    parser.add_argument("--names", nargs="+", default=["blocks.15.hook_resid_post"])
    parser.add_argument("--prompts", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=128, help="tokens per prompt")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--cpus-per-worker", type=float, default=0.5)
    parser.add_argument("--block-prompts", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--work", type=Path, default=Path("/tmp/vlens-bench-harvest"))
    parser.add_argument("--out", type=Path, default=Path("bench/out-cpu-harvest/harvest.json"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(json.loads(args.child))

    sys.path.insert(0, str(Path(__file__).parent))
    from run import GPU_PRESET, model_folder
    from transformers import AutoConfig

    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    if args.preset == "gpu":
        model, dtype, engine = model_folder(GPU_PRESET, args.work), "bfloat16", {
            key: value for key, value in GPU_PRESET["engine"].items()
            if key != "max_num_seqs"}  # the harvest's batches are --batch-size prompts
    else:
        model, dtype, engine = model_folder({"model": "smollm2"}, args.work), "float32", {}
    vocab = min(AutoConfig.from_pretrained(model).vocab_size, 100_000)
    sizes = {"small": args.prompts // 8, "large": args.prompts}
    files = {size: prompt_file(args.work / f"{size}.jsonl", count, args.tokens, vocab, 0)
             for size, count in sizes.items()}
    common = {"model": str(model), "names": args.names, "batch_size": args.batch_size,
              "dtype": dtype, "engine": engine, "block_prompts": args.block_prompts,
              "cpus_per_worker": args.cpus_per_worker}
    # On a CPU, Ray gives a worker of a fraction of a CPU one OpenMP thread: each worker gets
    # its share of the cores instead, as the single engine gets them all.
    cores = None if args.preset == "gpu" else os.cpu_count()
    commands = {"one engine": (None, None)}
    for workers in args.workers:
        commands[f"ray, {workers} workers"] = (workers, cores and max(1, cores // workers))
    # A first process pays for what later ones find cached (kernels, compiled code): not timed.
    run({**common, "workers": None, "prompts": str(files["small"]),
         "out": str(args.work / "warm-up")}, args.work / "warm-up.log", None)
    results: dict[str, dict] = {}
    for label, (workers, threads) in commands.items():
        seconds = {}
        for size, prompts in files.items():
            out = args.work / f"{label.replace(' ', '_').replace(',', '')}-{size}"
            configuration = {**common, "workers": workers, "prompts": str(prompts),
                             "out": str(out)}
            seconds[size] = run(configuration, out.with_suffix(".log"), threads)
            print(f"{label}, {size}: {seconds[size]:.1f} s", flush=True)
        rows = {size: count * args.tokens for size, count in sizes.items()}
        marginal = (rows["large"] - rows["small"]) / (seconds["large"] - seconds["small"])
        results[label] = {"seconds": seconds, "rows": rows, "tokens_per_second": marginal,
                          "configuration": configuration, "OMP_NUM_THREADS": threads}
    reference = rows_of(args.work / "one_engine-large")
    for label in commands:
        sample = rows_of(args.work / f"{label.replace(' ', '_').replace(',', '')}-large")
        assert sample.keys() == reference.keys(), label
        results[label]["sample_equal"] = all(
            torch.equal(sample[i][name], reference[i][name])
            for i in reference for name in reference[i])
    base = results["one engine"]["tokens_per_second"]
    for label, result in results.items():
        result["ratio"] = result["tokens_per_second"] / base
        print(f"{label:18} {result['tokens_per_second']:9,.0f} tokens/s  {result['ratio']:.2f}x"
              f"  whole large run {result['seconds']['large']:.1f} s"
              f"  rows equal: {result['sample_equal']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "argv": sys.argv, "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(), "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
