"""Activation patching: ``vlens.patching`` (one batched vLLM call) against TransformerLens's
``transformer_lens.patching`` on its ``TransformerBridge`` (HuggingFace), side by side in ONE run.

    python bench/patching.py                 # the IOI prompt, SmolLM2-135M, fp32, this CPU
    python bench/patching.py --prompts 8     # the notebook's 8 prompts as one batch
    python bench/patching.py --graph-hooks   # and the same sweep on a compiled engine

The sweep is ``get_act_patch_resid_pre``: every layer × every position of the residual stream
entering each block, patched from the clean run into the corrupted one. Prompts and metric are
TransformerLens's ``demos/Exploratory_Analysis_Demo.ipynb``: clean "When John and Mary went to
the shops, John gave the bag to" (answer " Mary" over " John"), corrupted the same with Mary in
the last clause; ``--prompts 8`` takes all 8 of its prompts, each corrupted by its partner. The
metric is the notebook's normalised logit difference at the last position,
``(diff(patched) - diff(corrupted)) / (diff(clean) - diff(corrupted))``, each backend's clean and
corrupted differences from its own forward.

Both models read the same float32 SmolLM2 folder (:func:`vlens.testing.embedded.smollm2_path`); the
tokens are the bridge's ``to_tokens(prompts, prepend_bos=True)``, fed as the same tensor to
both. Each side's clean cache is made before timing (as a user would). Timed, alternating,
``--reps`` times each, best counts:

- *vlens*: ``vlens.patching.get_act_patch_resid_pre(model, corrupted, cache, metric)``;
- *vlens, final logits*: the same with ``final_logits_only=True`` (the metric gets
  ``[batch, 1, d_vocab]``: the logits vLLM computes anyway for sampling);
- *vlens, hooks in the graph* (``--graph-hooks``): both of the above on a compiled engine whose
  residual stream runs hook functions (``compiled_hooks=["blocks.*.hook_resid_pre"]``), with its own
  clean cache and metric;
- *TransformerLens*: ``transformer_lens.patching.get_act_patch_resid_pre`` on the bridge
  (``boot_transformers`` + ``enable_compatibility_mode(no_processing=True)``): one HuggingFace
  forward per (layer, position).

The results are compared (max abs difference of the swept metric) and written, with the command,
the machine's load and every repetition, to ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any

os.environ.setdefault("TQDM_DISABLE", "1")  # TransformerLens's per-cell progress bar

import torch

PROMPT_FORMATS = [
    "When John and Mary went to the shops,{} gave the bag to",
    "When Tom and James went to the park,{} gave the ball to",
    "When Dan and Sid went to the shops,{} gave an apple to",
    "After Martin and Amy went to the park,{} gave a drink to",
]
NAMES = [(" Mary", " John"), (" Tom", " James"), (" Dan", " Sid"), (" Martin", " Amy")]


def notebook_prompts(n: int) -> tuple[list[str], list[str], list[tuple[str, str]]]:
    """The notebook's first ``n`` clean prompts, their answers (correct, incorrect) and corrupted
    prompts (each prompt's partner: the same with the other name in the last clause)."""
    clean, answers = [], []
    for i in range(len(PROMPT_FORMATS)):
        for j in range(2):
            answers.append((NAMES[i][j], NAMES[i][1 - j]))
            clean.append(PROMPT_FORMATS[i].format(answers[-1][1]))
    corrupted = [clean[i + 1 - 2 * (i % 2)] for i in range(len(clean))]
    return clean[:n], corrupted[:n], answers[:n]


def logit_diff(logits: torch.Tensor, answer_tokens: torch.Tensor) -> torch.Tensor:
    """The notebook's ``logits_to_ave_logit_diff``: mean over prompts of the last position's
    correct minus incorrect logit."""
    final = logits[:, -1, :]
    answer_logits = final.gather(dim=-1, index=answer_tokens.to(final.device))
    return (answer_logits[:, 0] - answer_logits[:, 1]).mean()


def normalised_metric(answer_tokens: torch.Tensor, clean_diff: float, corrupted_diff: float):
    def metric(logits: torch.Tensor) -> torch.Tensor:
        return (logit_diff(logits, answer_tokens) - corrupted_diff) / (clean_diff - corrupted_diff)

    return metric


def load_snapshot() -> dict[str, Any]:
    """The machine's load now: load averages and the busiest processes."""
    top = subprocess.run(
        ["ps", "aux", "--sort=-%cpu"], capture_output=True, text=True, check=False
    ).stdout.splitlines()[:6]
    return {"loadavg": os.getloadavg(), "top": top}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=1, choices=range(1, 9))
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--out", default="/tmp/bench-patching.json")
    parser.add_argument("--graph-hooks", action="store_true",
                        help="also sweep on a compiled engine with compiled_hooks")
    args = parser.parse_args(argv)

    import transformer_lens.patching as tl_patching
    from transformer_lens.model_bridge import TransformerBridge

    from vlens import HookedVLLM
    from vlens import patching as vlens_patching
    from vlens.testing.embedded import smollm2_path

    path = str(smollm2_path())
    bridge = TransformerBridge.boot_transformers(path, dtype=torch.float32)
    bridge.enable_compatibility_mode(no_processing=True)
    model = HookedVLLM.from_pretrained(path, dtype="float32")
    graph_hooks = (
        HookedVLLM.from_pretrained(path, dtype="float32",
                                   compiled_hooks=["blocks.*.hook_resid_pre"])
        if args.graph_hooks else None
    )

    clean_prompts, corrupted_prompts, answers = notebook_prompts(args.prompts)
    clean = bridge.to_tokens(clean_prompts, prepend_bos=True).cpu()
    corrupted = bridge.to_tokens(corrupted_prompts, prepend_bos=True).cpu()
    assert clean.shape == corrupted.shape, "the prompts must have one length, as in the notebook"
    answer_tokens = torch.tensor(
        [[bridge.to_single_token(a), bridge.to_single_token(b)] for a, b in answers]
    )
    n_layers, n_pos = model.cfg.n_layers, clean.shape[1]

    # Each side's clean cache (resid_pre only) and its own clean/corrupted logit differences.
    with torch.no_grad():
        tl_clean_logits, tl_cache = bridge.run_with_cache(
            clean, names_filter=lambda name: name.endswith("hook_resid_pre")
        )
        tl_corrupted_logits = bridge(corrupted)
    diffs = {
        "transformer_lens": (
            logit_diff(tl_clean_logits, answer_tokens).item(),
            logit_diff(tl_corrupted_logits, answer_tokens).item(),
        ),
    }
    tl_metric = normalised_metric(answer_tokens, *diffs["transformer_lens"])
    workloads: dict[str, Callable[[], torch.Tensor]] = {}
    engines = {"vlens": model, "vlens_graph_hooks": graph_hooks}
    for label, engine in engines.items():
        if engine is None:
            continue
        clean_logits, cache = engine.run_with_cache(
            clean, names_filter=lambda name: name.endswith("hook_resid_pre")
        )
        diffs[label] = (
            logit_diff(clean_logits, answer_tokens).item(),
            logit_diff(engine(corrupted), answer_tokens).item(),
        )
        metric = normalised_metric(answer_tokens, *diffs[label])
        workloads[label] = partial(
            vlens_patching.get_act_patch_resid_pre, engine, corrupted, cache, metric
        )
        workloads[f"{label}_final_logits"] = partial(
            vlens_patching.get_act_patch_resid_pre, engine, corrupted, cache, metric,
            final_logits_only=True,
        )

    def run_transformer_lens() -> torch.Tensor:
        with torch.no_grad():
            return tl_patching.get_act_patch_resid_pre(bridge, corrupted, tl_cache, tl_metric)

    workloads["transformer_lens"] = run_transformer_lens
    vlens_runs = [name for name in workloads if name != "transformer_lens"]
    # Warm-up: one forward each (first-call allocations, lazy imports).
    with torch.no_grad():
        bridge(corrupted)

    load_before = load_snapshot()
    seconds: dict[str, list[float]] = {name: [] for name in workloads}
    results: dict[str, torch.Tensor] = {}
    for _ in range(args.reps):
        for name, run in workloads.items():
            start = time.perf_counter()
            results[name] = run()
            seconds[name].append(time.perf_counter() - start)
            print(f"{name}: {seconds[name][-1]:.2f} s", file=sys.stderr, flush=True)
    load_after = load_snapshot()

    best = {name: min(times) for name, times in seconds.items()}
    reference = results["transformer_lens"]
    report = {
        "command": " ".join(["python bench/patching.py", *(argv or sys.argv[1:])]),
        "model": path,
        "prompts": {"clean": clean_prompts, "corrupted": corrupted_prompts, "answers": answers},
        "sweep": {"layers": n_layers, "positions": n_pos, "batch": int(clean.shape[0]),
                  "cells": n_layers * n_pos, "requests": n_layers * n_pos * int(clean.shape[0])},
        "logit_diffs_clean_corrupted": diffs,
        "torch_threads": torch.get_num_threads(),
        "seconds": seconds,
        "best_seconds": best,
        "speedup_vs_transformer_lens": {
            name: best["transformer_lens"] / best[name] for name in vlens_runs
        },
        "max_abs_diff_vs_transformer_lens": {
            name: (results[name] - reference).abs().max().item() for name in vlens_runs
        },
        "graph_hooks_vs_eager": {
            name: {"speed": best[name.replace("_graph_hooks", "")] / best[name],
                   "max_abs_diff": (results[name] - results[name.replace("_graph_hooks", "")])
                   .abs().max().item()}
            for name in vlens_runs if "graph_hooks" in name
        },
        "max_abs_result": reference.abs().max().item(),
        "load_before": load_before,
        "load_after": load_after,
    }
    with open(args.out, "w") as handle:
        json.dump(report, handle, indent=2)
    torch.save(results, os.path.splitext(args.out)[0] + ".pt")
    print(json.dumps({key: report[key] for key in (
        "sweep", "best_seconds", "speedup_vs_transformer_lens", "max_abs_diff_vs_transformer_lens",
        "max_abs_result", "logit_diffs_clean_corrupted", "graph_hooks_vs_eager", "torch_threads")},
        indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
