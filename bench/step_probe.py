"""Where a compiled engine's steps spend their time, per rank: plain generation against vlens's
steering and one layer's capture, on one engine (the compiled engine, ``bench/run.py``'s workload);
with ``--every-layer``, against every layer's capture instead.

    python bench/step_probe.py --preset gpu --tensor-parallel-size 2 --out OUT_DIR
    python bench/step_probe.py --preset gpu --every-layer --executor mp --out OUT_DIR

Each worker's model runner is wrapped (through ``collective_rpc``) to time, per step, the wall
time of ``execute_model`` and of vlens's work around the forward (``before_step``: steering
terms, ``after_step``: kept rows), and the hand-back (``finish``); in the user's process, vLLM's
``generate`` and the hand-back as seen from there. ``after_step`` is split further into its
pieces (:data:`PHASES`: selecting the kept rows, the host stream's work; the rest is stacking
them), and its four longest steps (a generation's prefill steps) are summed apart. Written to
``OUT_DIR/step_probe.json`` and printed: for each workload and rank, the steps, their mean wall
time, and vlens's share; with the call's total.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from run import PRESETS, model_folder, prompts_for


def install_timers(worker: Any) -> int:
    """In a worker: time ``execute_model`` and the compiled engine's step work into lists."""
    from vlens.runtime.worker import runtime_of

    runtime = runtime_of(worker)
    graph, runner = runtime.graph, worker.model_runner
    times: dict[str, list[float]] = {"execute": [], "before": [], "after": [], "finish": []}
    worker._vlens_step_times = times

    def timed(key: str, function: Any) -> Any:
        return timed_into(times[key], function)

    runner.execute_model = timed("execute", runner.execute_model)
    graph.before_step = timed("before", graph.before_step)
    graph.after_step = timed("after", graph.after_step)
    runtime.finish = timed("finish", runtime.finish)
    install_phase_timers(times)
    return runtime.parallel.rank if runtime.parallel else 0


#: the pieces of ``after_step`` timed on their own: (module, attribute), the key they count under
PHASES = {
    ("vlens.runtime.compiled.graph", "kept_rows"): "select the rows",
    ("vlens.runtime.compiled.graph", "GraphSites._selected_rows"): "the rows of each name",
    ("vlens.runtime.transfer.host_stream", "HostStream.begin_step"): "stream begin_step",
    ("vlens.runtime.transfer.host_stream", "HostStream.write"): "stream write",
    ("vlens.runtime.transfer.host_stream", "HostStream.end_step"): "stream end_step",
}


def install_phase_timers(times: dict[str, list[float]]) -> None:
    """Wrap the pieces of :data:`PHASES` where they are looked up (module globals, class
    attributes), once per process."""
    import importlib

    for (module_name, attribute), key in PHASES.items():
        times[key] = []
        owner: Any = importlib.import_module(module_name)
        *path, name = attribute.split(".")
        for part in path:
            owner = getattr(owner, part)
        function = getattr(owner, name)
        original = getattr(function, "_probe_original", function)
        wrapped = timed_into(times[key], original)
        wrapped._probe_original = original  # type: ignore[attr-defined]
        setattr(owner, name, wrapped)


def timed_into(into: list[float], function: Any) -> Any:
    """``function``, adding each call's seconds to ``into``."""

    def call(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            into.append(time.perf_counter() - start)

    return call


def read_timers(worker: Any) -> dict[str, Any]:
    """In a worker: the step times since the last read (then cleared)."""
    times = worker._vlens_step_times
    summary = {
        key: {"count": len(values), "total_s": sum(values),
              "largest_4_s": sum(sorted(values)[-4:])}
        for key, values in times.items()
    }
    for values in times.values():
        values.clear()
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", default="gpu", choices=sorted(PRESETS))
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--work", type=Path, default=Path("/tmp/vlens-bench"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--every-layer", action="store_true",
                        help="declare and capture every layer's resid_post (no steering)")
    parser.add_argument("--executor", choices=("uni", "mp"),
                        help="vLLM's distributed_executor_backend")
    args = parser.parse_args(argv)

    import torch
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from vlens import HookedVLLM, Steer

    preset = PRESETS[args.preset]
    engine = {**preset["engine"]}
    if args.tensor_parallel_size > 1:
        engine["tensor_parallel_size"] = args.tensor_parallel_size
    if args.executor:
        engine["distributed_executor_backend"] = args.executor
    path = model_folder(preset, args.work)
    one = f"blocks.{preset['layer']}.hook_resid_post"
    declared: dict[str, Any] = {"compiled_capture": [one], "compiled_steering": [one]}
    if args.every_layer:
        layers = json.loads((path / "config.json").read_text())["num_hidden_layers"]
        declared = {"compiled_capture": [f"blocks.{layer}.hook_resid_post"
                                         for layer in range(layers)]}
    model = HookedVLLM.from_pretrained(path, dtype=preset["dtype"], **declared, **engine)
    llm = model.engine.llm
    here: dict[str, list[float]] = {"generate": [], "finish": []}  # the user's process
    model.engine.finish = timed_into(here["finish"], model.engine.finish)
    llm.generate = timed_into(here["generate"], llm.generate)
    prompts = prompts_for(preset, model.cfg.d_vocab)
    new = preset["new_tokens"]
    generator = torch.Generator().manual_seed(1)
    vectors = [torch.randn(model.cfg.d_model, generator=generator) for _ in prompts]

    def plain() -> None:
        params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)

    def generated(**asked: Any) -> None:
        model.generate(prompts, max_new_tokens=new, do_sample=False, stop_at_eos=False,
                       return_type="input", **asked)

    workloads = {
        "plain": plain,
        "generate": generated,
        "steer": lambda: generated(prompt_steering=[[Steer(one, add=v)] for v in vectors]),
        "steer_shared": lambda: generated(steering=[Steer(one, add=vectors[0])]),
        "cache": lambda: model.run_with_cache(prompts, names_filter=[one], return_type=None,
                                              max_new_tokens=new),
    }
    if args.every_layer:
        for name in ("steer", "steer_shared", "cache"):
            del workloads[name]
        workloads["cache_all"] = lambda: model.run_with_cache(
            prompts, names_filter=declared["compiled_capture"], return_type=None,
            max_new_tokens=new)
    for run in workloads.values():  # warm: first calls pin memory, stack tables
        run()
    ranks = llm.collective_rpc(install_timers)
    results: list[dict[str, Any]] = []
    for rep in range(args.reps):
        for name, run in workloads.items():
            llm.collective_rpc(read_timers)
            for values in here.values():
                values.clear()
            start = time.perf_counter()
            run()
            seconds = time.perf_counter() - start
            per_rank = llm.collective_rpc(read_timers)
            mine = {key: sum(values) for key, values in here.items()}
            results.append({"workload": name, "rep": rep, "seconds": seconds,
                            "ranks": dict(zip(ranks, per_rank)), "user_process": mine})
            line = (f"{name:13s} rep {rep}: {seconds:6.3f} s (generate {mine['generate']:.3f}, "
                    f"hand-back {mine['finish']:.3f})")
            for rank, times in zip(ranks, per_rank):
                steps = times["execute"]["count"]
                line += (f" | rank {rank}: {steps} steps, execute "
                         f"{1e3 * times['execute']['total_s'] / max(steps, 1):.2f} ms/step, "
                         f"vlens before {1e3 * times['before']['total_s'] / max(steps, 1):.3f} "
                         f"after {1e3 * times['after']['total_s'] / max(steps, 1):.3f} ms/step, "
                         f"finish {times['finish']['total_s']:.3f} s")
                after = times["after"]
                phases = "".join(
                    f"; {key} {1e3 * times[key]['total_s'] / max(steps, 1):.3f} ms/step"
                    for key in PHASES.values() if times[key]["count"]
                )
                line += f" (after: {1e3 * after['largest_4_s']:.1f} ms in its 4 longest steps{phases})"
            print(line, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "step_probe.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
