"""First and second loads: plain compiled vLLM against the engine ``from_pretrained`` gives.

    python bench/loads.py --preset gpu-short --out OUT_DIR

Each load runs in a fresh process (nothing of one load stays in memory for the next), in the
order plain, vlens, plain, vlens, all with the same ``VLLM_CACHE_ROOT`` (by default an empty
folder under ``--work``, removed first): the first round fills vLLM's compile cache, the second
reads it, as a user's second session does. Times are from the constructor's call to its return
(weights, compilation or its cache, CUDA graph capture, KV cache). ``OUT_DIR/loads.json`` holds
them with vLLM's log lines that time each phase (each load's log: ``OUT_DIR/load-R-ENGINE.log``);
the table goes to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from run import PRESETS, engine_args, model_folder

ENGINES = ("plain", "vlens")
#: with ``--aot``: vlens's engine with vLLM's ahead-of-time artifact on (vlens turns it off)
AOT = "vlens_aot"
#: vLLM's log lines that say where a load's time went (each load's whole log is kept beside)
PHASES = ("Model loading took", "Dynamo bytecode transform time", "compilation:",
          "Graph capturing finished", "Compiling model again", "Directly load AOT", "init engine")


def load(engine: str, preset: dict, path: Path) -> dict:
    """Seconds to build ``engine`` on ``path`` (in this process), and for vlens's engines what
    :func:`probe` finds in the engine loaded."""
    start = time.perf_counter()
    if engine == "plain":
        from vllm import LLM

        LLM(model=str(path), dtype=preset["dtype"], enforce_eager=False, **engine_args(preset))
        return {"seconds": time.perf_counter() - start}
    from vlens import HookedVLLM

    model = HookedVLLM.from_pretrained(path, dtype=preset["dtype"], **engine_args(preset))
    return {"seconds": time.perf_counter() - start, "probe": probe(model, preset["layer"])}


def probe(model, layer: int) -> dict:
    """A hook function's calls and a read name's values on the engine just loaded: a load that
    took a graph from a cache must still reach its hook sites. Dummy weights are seeded, so the
    sum is the same on every load of one checkpoint."""
    name = f"blocks.{layer}.hook_resid_post"
    prompts = [list(range(100, 112)), list(range(200, 205))]
    calls: list[tuple[int, ...]] = []
    model.generate(prompts, max_new_tokens=3, do_sample=False, stop_at_eos=False,
                   fwd_hooks=[(name, lambda x, hook: calls.append(tuple(x.shape)))])
    _, cache = model.run_with_cache(prompts, names_filter=[name], return_type=None)
    return {"hook_calls": len(calls), "cache_sum": float(cache[name].float().sum())}


def seconds_text(value: float | None) -> str:
    return "failed" if value is None else f"{value:.1f} s"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="gpu-short")
    parser.add_argument("--out", type=Path, default=Path("bench/out-loads"))
    parser.add_argument("--work", type=Path, default=Path("/tmp/vlens-loads"))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--aot", action="store_true",
                        help="also load vlens's engine with VLLM_USE_AOT_COMPILE=1")
    parser.add_argument("--engine", choices=(*ENGINES, AOT), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    preset = PRESETS[args.preset]
    path = model_folder(preset, args.work)
    if args.engine:  # one load, in its own process
        print(json.dumps(load(args.engine, preset, path)), flush=True)
        return 0

    args.out.mkdir(parents=True, exist_ok=True)
    cache = args.work / "vllm-cache"
    shutil.rmtree(cache, ignore_errors=True)
    env = {**os.environ, "VLLM_CACHE_ROOT": str(cache), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    rows = []
    engines = (*ENGINES, AOT) if args.aot else ENGINES
    for round_ in range(1, args.rounds + 1):
        for engine in engines:
            command = [sys.executable, __file__, "--preset", args.preset, "--work",
                       str(args.work), "--engine", engine]
            aot = {"VLLM_USE_AOT_COMPILE": "1"} if engine == AOT else {}
            done = subprocess.run(command, env={**env, **aot}, capture_output=True, text=True)
            lines = [line for line in done.stdout.splitlines() if line.startswith('{"seconds"')]
            result = json.loads(lines[-1]) if done.returncode == 0 and lines else {}
            seconds = result.get("seconds")
            if seconds is None:
                print(done.stderr[-3000:], file=sys.stderr)
            log = done.stdout + done.stderr
            (args.out / f"load-{round_}-{engine}.log").write_text(log)
            phases = [line.split("] ", 1)[-1] for line in log.splitlines()
                      if any(phase in line for phase in PHASES)]
            rows.append({"round": round_, "engine": engine, "seconds": seconds, "phases": phases,
                         "probe": result.get("probe")})
            print(f"[loads] round {round_} {engine:6s} {seconds_text(seconds)}"
                  + (f" probe {result['probe']}" if "probe" in result else ""), flush=True)
            for phase in phases:
                print(f"[loads]     {phase}", flush=True)
    (args.out / "loads.json").write_text(json.dumps(
        {"preset": args.preset, "command": " ".join(sys.argv), "rows": rows}, indent=1))
    print("| round | plain compiled vLLM | vlens `from_pretrained(path)` | ratio |")
    print("| --- | --- | --- | --- |")
    for round_ in range(1, args.rounds + 1):
        plain, ours = (next(r["seconds"] for r in rows if r["round"] == round_ and r["engine"] == e)
                       for e in ENGINES)
        ratio = f"{ours / plain:.2f}" if plain and ours else "—"
        print(f"| {round_} | {seconds_text(plain)} | {seconds_text(ours)} | {ratio} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
