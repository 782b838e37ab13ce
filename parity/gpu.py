"""``python -m vlens.parity.gpu``: the parity check on a CUDA device, and steering isolation.

Run it once per model runner (vLLM reads ``VLLM_USE_V2_MODEL_RUNNER`` when the engine is built;
``tools/gpu/gpu.sh`` runs both at once). For each tiny architecture and each ``--dtype``, one
engine; every canonical name is compared with HuggingFace (fp32, eager attention, on the CPU, same
checkpoint), on the prompts (*prefill*) and on the prompts continued by greedy decoding (*decode*),
for the prompts submitted together (*batch*: a mixed batch of different lengths) and each
submitted alone (*single*).

Pass criteria, per token (per query position for patterns):

- ``float32``: max relative error ``‖vlens − ref‖/‖ref‖ <= 1e-4``, the CPU tolerance;
- ``bfloat16`` (vlens in bf16 against HuggingFace in fp32 on the same weights): min cosine
  ``>= 0.9999`` (*strict*). bf16 arithmetic alone misses that on the tiny checkpoints (their
  large init makes attention sharp and MLP outputs cancel): HuggingFace's own model cast to bf16,
  on the same tokens, reaches only ~0.9989 against itself in fp32 by the last layer. So each bf16
  row also carries that *floor* (HuggingFace bf16 vs HuggingFace fp32, same name, same tokens)
  and passes if it is strict or if its cosine deficit ``1 − cos`` is at most twice the floor's.
  A wrong row, head, position or sign gives deficits of order 1.

Isolation (``--isolation``): prompt 0 steered (a fixed vector added to one layer's
``hook_resid_post``), the others not, all in one ``generate`` call; the unsteered prompts' tokens
must equal their solo runs, the steered one's its solo steered run; and, against the same batch run
without the steering hook, the unsteered prompts' last-layer residuals at every step must be
bitwise equal (same batch, same kernels: any difference is a leak).

``--report A.json B.json ...`` merges the JSON files of such runs into Markdown tables.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import shutil
import sys
import time
import traceback
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from vlens.names.mapping import ArchitectureMapping
from vlens.parity.compare import FP32_MAX_REL, PROMPTS
from vlens.parity.reference import hf_reference
from vlens.parity.run import DECODE_STEPS, rows_against

BF16_MIN_COS = 0.9999
ISOLATION_STEPS = 8


def strict(row: dict[str, Any], dtype: str) -> bool:
    if dtype == "float32":
        return row["max_rel"] <= FP32_MAX_REL
    return row["min_cos"] >= BF16_MIN_COS


def passes(row: dict[str, Any], dtype: str) -> bool:
    if strict(row, dtype) or dtype == "float32":
        return strict(row, dtype)
    floor = row.get("floor_cos")
    return floor is not None and 1 - row["min_cos"] <= 2 * (1 - floor)


def criterion(dtype: str) -> str:
    if dtype == "float32":
        return f"max rel <= {FP32_MAX_REL:g}"
    return f"min cos >= {BF16_MIN_COS}, or 1-cos <= 2x HF-bf16's"


@torch.no_grad()
def hf_reference_in(path: Path, prompts: list[list[int]], dtype: torch.dtype) -> list[dict]:
    """:func:`~vlens.parity.reference.hf_reference` with the HuggingFace model cast to ``dtype``."""
    from vlens.parity import reference

    model = reference.load_hf(path).to(dtype)
    recorder = reference.Recorder()
    to_values = reference.recorder_for(model.config.architectures[0])(model, recorder)
    try:
        results = []
        for prompt in prompts:
            output = model(torch.tensor([prompt]), output_attentions=True)
            values = to_values(output.logits, output.attentions)
            results.append({name: value.float() for name, value in values.items()})
        return results
    finally:
        recorder.remove()


def auto_archs() -> list[str]:
    """The tiny models the mapping files declare, but for those their mapping says vLLM on CUDA
    cannot run as they are (``ArchitectureMapping.tiny_off_cuda``: DeepSeek's, which
    ``tools/gpu/gpu_deepseek.sh`` runs with other dimensions)."""
    from vlens.mappings import all_mappings

    return [
        name
        for mapping in all_mappings()
        if mapping.tiny_off_cuda is None
        for name in mapping.tiny_configs
    ]


def checkpoint_for_vllm(path: Path, mapping: ArchitectureMapping) -> Path:
    """The checkpoint vLLM loads: ``path``, or, for an architecture served by vLLM's Transformers
    backend on a vLLM whose backend applies only the base model's weight renamings (0.26), a copy
    beside it whose weights carry the names of HuggingFace's modules where the checkpoint's differ
    (GPT-NeoX saves its head as ``embed_out``, a module transformers 5 calls ``lm_head``): the
    same tensors under the names that backend loads. vLLM's native models load the hub's names
    (the checkpoint's), never transformers' in-memory ones (GraniteMoe's fused
    ``experts.down_proj``). HuggingFace's reference keeps reading ``path``."""
    if mapping.model_impl != "transformers":
        return path
    try:
        from vllm.model_executor.models.transformers import base
    except ImportError:
        return path
    if hasattr(base, "get_checkpoint_conversion_mapping"):  # applies the model class's renamings
        return path
    from safetensors import safe_open
    from safetensors.torch import save_file

    from vlens.parity import reference

    shards = sorted(path.glob("*.safetensors"))
    saved = {key for shard in shards for key in safe_open(shard, "pt").keys()}
    model = reference.load_hf(path)
    tensors = {name: value.detach().clone() for name, value in model.state_dict().items()}
    if saved <= set(tensors):
        return path
    copy = path.with_name(f"{path.name}-module-names")
    shutil.copytree(path, copy, dirs_exist_ok=True)
    for stale in [*copy.glob("*.safetensors"), *copy.glob("*.safetensors.index.json")]:
        stale.unlink()
    save_file(tensors, copy / "model.safetensors", metadata={"format": "pt"})
    return copy


def runner_of(model: Any) -> Any:
    return model.engine.llm.llm_engine.model_executor.driver_worker.worker.model_runner


def runner_label(model: Any) -> str:
    from vlens.runtime.steps.layout import runner_kind

    runner = runner_of(model)
    return f"{runner_kind(runner).upper()} ({type(runner).__module__})"


def caches(model: Any, prompts: list[list[int]], new_tokens: int, single: bool):
    """Per prompt: its token sequence and every cached name's value ``[pos, ...]``."""
    groups = [[p] for p in prompts] if single else [prompts]
    sequences, values = [], []
    for group in groups:
        _, cache = model.run_with_cache(group, max_new_tokens=new_tokens)
        for i, n in enumerate(cache.lengths):
            sequences.append(cache.tokens[i, : int(n)].tolist())
            values.append({name: cache.unpadded(name, i).cpu() for name in cache.keys()})
    return sequences, values


def parity_rows(model: Any, path: Path, dtype: str) -> tuple[list[dict[str, Any]], list[str]]:
    """One row per name and mode against HuggingFace fp32; in bf16 each row also carries the
    floor (HuggingFace bf16 against HuggingFace fp32, same name, same tokens)."""
    prompts = model.token_lists(list(PROMPTS))
    rows: list[dict[str, Any]] = []
    for batching in ("batch", "single"):
        for mode, new_tokens in (("prefill", 0), ("decode", DECODE_STEPS)):
            label = f"{mode}/{batching}"
            sequences, ours = caches(model, prompts, new_tokens, batching == "single")
            theirs = hf_reference(path, sequences)
            found = rows_against("HuggingFace", label, ours, theirs)
            floors = {}
            if dtype != "float32":
                low = hf_reference_in(path, sequences, getattr(torch, dtype))
                floors = {r.name: r.min_cos for r in rows_against("HF-bf16", label, low, theirs)}
            for row in found:
                rows.append({**asdict(row), "layer": row.layer, "floor_cos": floors.get(row.name)})
    covered = {row["name"] for row in rows}
    return rows, [name for name in model.hook_names if name not in covered]


def isolation(model: Any) -> dict[str, Any]:
    prompts = model.token_lists(list(PROMPTS))
    n_layers = model.cfg.n_layers
    steered_name = f"blocks.{n_layers // 2}.hook_resid_post"
    watched = f"blocks.{n_layers - 1}.hook_resid_post"
    vector = 20 * torch.randn(model.cfg.d_model, generator=torch.Generator().manual_seed(3))

    def steer(x, hook):
        return x + vector.to(x.device, x.dtype)

    def recorder(store: list):
        def record(x, hook):
            store.append((hook.positions.clone(), x[0].detach().float().cpu()))

        return record

    def rows(store: list) -> torch.Tensor:
        ordered = sorted(store, key=lambda item: int(item[0][0]))
        return torch.cat([value for _, value in ordered])

    kwargs = dict(max_new_tokens=ISOLATION_STEPS, do_sample=False, stop_at_eos=False)
    kwargs["return_type"] = "tokens"
    plain_solo = [model.generate([p], **kwargs)[0] for p in prompts]
    steered_solo = model.generate([prompts[0]], fwd_hooks=[(steered_name, steer)], **kwargs)[0]

    def batch(steered: bool):
        stores = [[] for _ in prompts]
        hooks = [[(watched, recorder(stores[i]))] for i in range(len(prompts))]
        if steered:
            hooks[0] = [(steered_name, steer)]
        tokens = model.generate(prompts, prompt_hooks=hooks, **kwargs)
        return tokens, stores

    unsteered = range(1, len(prompts))
    steered_tokens, steered_stores = batch(steered=True)
    plain_tokens, plain_stores = batch(steered=False)
    leaks = []
    for i in unsteered:
        a, b = rows(steered_stores[i]), rows(plain_stores[i])
        leaks.append(float((a - b).abs().max()))
    result = {
        "steered_name": steered_name,
        "watched": watched,
        "steps": ISOLATION_STEPS,
        "steering_changes_tokens": steered_solo != plain_solo[0],
        "steered_in_batch_equals_solo": steered_tokens[0] == steered_solo,
        "unsteered_equal_solo": [steered_tokens[i] == plain_solo[i] for i in unsteered],
        "plain_batch_equals_solo": [plain_tokens[i] == plain_solo[i] for i in range(len(prompts))],
        "unsteered_max_abs_diff_vs_same_batch_unsteered": leaks,
    }
    result["ok"] = bool(
        result["steering_changes_tokens"]
        and result["steered_in_batch_equals_solo"]
        and all(result["unsteered_equal_solo"])
        and max(leaks) == 0.0
    )
    return result


def close(model: Any) -> None:
    try:
        model.engine.llm.llm_engine.engine_core.shutdown()
    except Exception:
        traceback.print_exc()


def run(args: argparse.Namespace) -> int:
    import vllm
    from transformers import AutoConfig

    from vlens.engine.arguments import architecture_args
    from vlens.hooked.model import HookedVLLM
    from vlens.mappings import mapping_for
    from vlens.testing.tiny import ARCHS, tiny_model

    threads = os.environ.get("PARITY_THREADS") or max(1, (os.cpu_count() or 2) // 2)
    torch.set_num_threads(int(threads))
    archs = args.models or auto_archs()
    meta = {
        "date": str(datetime.date.today()),
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.machine(),
        "VLLM_USE_V2_MODEL_RUNNER": os.environ.get("VLLM_USE_V2_MODEL_RUNNER"),
        "TRITON_F32_DEFAULT": os.environ.get("TRITON_F32_DEFAULT"),
        "label": args.label,
        "command": " ".join(sys.argv),
    }
    results: list[dict[str, Any]] = []
    failed = False

    def save() -> None:
        if args.json:
            args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=1))

    for arch in archs:
        for dtype in args.dtype:
            entry: dict[str, Any] = {"arch": Path(arch).name, "dtype": dtype}
            entry["criterion"] = criterion(dtype)
            start = time.time()
            model = None
            try:
                path = tiny_model(arch) if arch in ARCHS else Path(arch)
                memory = {}
                if torch.cuda.is_available():
                    memory = dict(
                        gpu_memory_utilization=args.gpu_memory_utilization,
                        kv_cache_memory_bytes=args.kv_cache_gib << 30,
                    )
                mapping = mapping_for(AutoConfig.from_pretrained(path))
                entry["engine_args"] = architecture_args(mapping)
                model = HookedVLLM.from_pretrained(
                    checkpoint_for_vllm(path, mapping), dtype=dtype, **memory
                )
                entry["runner"] = runner_label(model)
                entry["rows"], uncovered = parity_rows(model, path, dtype)
                entry["uncovered"] = uncovered
                entry["failing"] = sorted(
                    {f"{r['name']} ({r['mode']})" for r in entry["rows"] if not passes(r, dtype)}
                )
                if args.isolation:
                    entry["isolation"] = isolation(model)
                ok = not entry["failing"] and entry.get("isolation", {}).get("ok", True)
                entry["ok"] = ok
            except Exception:
                entry["error"] = traceback.format_exc()
                entry["ok"] = False
                print(entry["error"], file=sys.stderr)
            finally:
                if model is not None:
                    close(model)
                del model
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            entry["seconds"] = round(time.time() - start, 1)
            failed |= not entry["ok"]
            results.append(entry)
            save()
            print(summary_line(meta, entry), flush=True)
    return 1 if failed else 0


# ---- the report ------------------------------------------------------------------------------


def summary_line(meta: dict[str, Any], entry: dict[str, Any]) -> str:
    return (
        f"[parity] runner={entry.get('runner', '?')} arch={entry['arch']} dtype={entry['dtype']} "
        f"ok={entry['ok']} failing={len(entry.get('failing', []))} "
        f"isolation={entry.get('isolation', {}).get('ok')} error={'error' in entry} "
        f"({entry['seconds']} s)"
    )


def arch_label(entry: dict[str, Any]) -> str:
    """The architecture, with the engine arguments its run was given (``model_impl``)."""
    extra = ", ".join(f"{k}={v}" for k, v in entry.get("engine_args", {}).items())
    return f"{entry['arch']} ({extra})" if extra else entry["arch"]


def worst(rows: list[dict[str, Any]], key: str, largest: bool) -> tuple[float, str]:
    pick = max if largest else min
    row = pick(rows, key=lambda r: r[key])
    return row[key], row["name"]


def per_name(title: str, entry: dict[str, Any]) -> str:
    """One row per name: its worst over every mode (prefill/decode, batch/single)."""
    lines = [f"#### {title}", "", "| name | worst max rel | min cosine | HF-bf16 floor | pass |",
             "| --- | --- | --- | --- | --- |"]
    for name in dict.fromkeys(r["name"] for r in entry["rows"]):
        rows = [r for r in entry["rows"] if r["name"] == name]
        floors = [r["floor_cos"] for r in rows if r.get("floor_cos") is not None]
        ok = all(passes(r, entry["dtype"]) for r in rows)
        lines.append(f"| `{name}` | {max(r['max_rel'] for r in rows):.2e} | "
                     f"{min(r['min_cos'] for r in rows):.7f} | "
                     f"{f'{min(floors):.7f}' if floors else '-'} | {'yes' if ok else '**NO**'} |")
    return "\n".join(lines) + "\n"


def report(files: list[Path], detail: tuple[str, ...] = ()) -> str:
    runs = [json.loads(file.read_text()) for file in files]
    details: list[str] = []
    lines = ["| date | vLLM | runner | arch | dtype | mode | names | worst max rel (name) | "
             "min cosine (name) | HF-bf16 floor: min cosine | strict | pass |",
             "| --- " * 12 + "|"]
    isolation_lines = [
        "| vLLM | runner | arch | dtype | steering changes tokens | steered in batch = solo | "
        "unsteered = solo | unsteered: max abs diff vs same batch unsteered | pass |",
        "| --- " * 9 + "|",
    ]
    failures, errors = [], []
    for run_ in runs:
        meta = run_["meta"]
        label = f" ({meta['label']})" if meta.get("label") else ""
        for entry in run_["results"]:
            runner = entry.get("runner", f"env V2={meta['VLLM_USE_V2_MODEL_RUNNER']}") + label
            if "error" in entry:
                message = entry["error"].strip().splitlines()[-1][:300]
                errors.append(f"- {runner}, {arch_label(entry)}, {entry['dtype']}: `{message}`")
                continue
            rows = entry["rows"]
            for mode in dict.fromkeys(r["mode"] for r in rows):
                chosen = [r for r in rows if r["mode"] == mode]
                rel, rel_name = worst(chosen, "max_rel", True)
                cos, cos_name = worst(chosen, "min_cos", False)
                floors = [r["floor_cos"] for r in chosen if r.get("floor_cos") is not None]
                floor = f"{min(floors):.7f}" if floors else "-"
                dtype = entry["dtype"]
                n_strict = sum(strict(r, dtype) for r in chosen)
                ok = all(passes(r, dtype) for r in chosen)
                lines.append(
                    f"| {meta['date']} | {meta['vllm']} | {runner} | {arch_label(entry)} | "
                    f"{dtype} | {mode} | {len(chosen)} | {rel:.2e} (`{rel_name}`) | "
                    f"{cos:.7f} (`{cos_name}`) | {floor} | {n_strict}/{len(chosen)} | "
                    f"{'yes' if ok else '**NO**'} |"
                )
            failing = sorted({r["name"] for r in rows if not passes(r, entry["dtype"])},
                             key=[r["name"] for r in rows].index)
            if failing:
                shown = ", ".join(f"`{name}`" for name in failing[:12])
                more = f" and {len(failing) - 12} more" if len(failing) > 12 else ""
                failures.append(f"- {runner}, {entry['arch']}, {entry['dtype']}: {len(failing)} "
                                f"name(s) in some mode: {shown}{more}")
            if entry.get("uncovered"):
                failures.append(f"- {runner}, {entry['arch']}, {entry['dtype']}: no reference "
                                f"for {', '.join(entry['uncovered'])}")
            if entry["arch"] in detail and runner.startswith("V2") and not label:
                details.append(per_name(f"{entry['arch']}, {entry['dtype']}, {runner}", entry))
            iso = entry.get("isolation")
            if iso:
                isolation_lines.append(
                    f"| {meta['vllm']} | {runner} | {entry['arch']} | {entry['dtype']} | "
                    f"{iso['steering_changes_tokens']} | {iso['steered_in_batch_equals_solo']} | "
                    f"{all(iso['unsteered_equal_solo'])} ({iso['unsteered_equal_solo']}) | "
                    f"{max(iso['unsteered_max_abs_diff_vs_same_batch_unsteered']):.1e} | "
                    f"{'yes' if iso['ok'] else '**NO**'} |"
                )
    out = ["### Parity (every name, worst per mode)", "", *lines, ""]
    if len(isolation_lines) > 2:
        out += ["### Steering isolation", "", *isolation_lines, ""]
    if failures:
        out += ["### Names over the criterion, or without reference", "", *failures, ""]
    if errors:
        out += ["### Errors", "", *errors, ""]
    if details:
        out += ["### Per name (worst over the four modes)", "", *details]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vlens.parity.gpu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="*",
                        help="tiny architectures or checkpoint folders (default: every tiny "
                        "model the mapping files declare that CUDA runs as it is)")
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"],
                        choices=["float32", "bfloat16"])
    parser.add_argument("--isolation", action="store_true", help="also check steering isolation")
    parser.add_argument("--json", type=Path, help="write the results here (after every engine)")
    parser.add_argument("--label", default="", help="a note shown next to the runner in reports")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.2)
    parser.add_argument("--kv-cache-gib", type=int, default=1,
                        help="fixed KV cache (skips vLLM's memory profiling, so that two runs "
                             "can share the GPU)")
    parser.add_argument("--report", nargs="+", type=Path, metavar="JSON",
                        help="print Markdown tables merging these JSON files, and exit")
    parser.add_argument("--detail", nargs="*", default=[], metavar="ARCH",
                        help="with --report: per-name tables for these architectures")
    args = parser.parse_args(argv)
    if args.report:
        print(report(args.report, tuple(args.detail)))
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
