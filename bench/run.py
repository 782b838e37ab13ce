"""What vlens costs against plain vLLM, measured side by side in ONE run.

    python bench/run.py --preset gpu --out OUT_DIR     # H200: Qwen3-8B shape, dummy bf16 weights
    python bench/run.py --preset gpu-llama --out OUT_DIR --tensor-parallel-size 2   # Llama-3-8B
    python bench/run.py --preset cpu --out OUT_DIR     # this CPU: SmolLM2-135M, fp32
    python bench/run.py --preset cpu-qwen3 --out OUT_DIR   # this CPU: a random ~0.3 B Qwen3, fp32

One run measures, in this order, each in its own process (an engine's memory is only ever given
back whole), the same prompts (random token ids, distinct, so no prefix is shared) and greedy
decoding:

- ``eager``: ONE vlens engine (``HookedVLLM`` with ``enforce_eager=True``, prefix caching off). *plain* is that
  engine's ``vllm.LLM.generate`` with no vlens request (no site installed: what plain eager vLLM
  costs); *cache_1* is ``run_with_cache`` of one layer's ``hook_resid_post``; *cache_all* of every
  layer's; *steer* is ``generate`` with one vector added at one layer's ``hook_resid_post`` (every
  prompt, every step). Workloads alternate, ``--reps`` times each; the best time counts.
- ``default``: the engine ``HookedVLLM.from_pretrained(path)`` gives with nothing declared (on a
  GPU compiled, with a hook site at every name; on the CPU eager), with the eager worker's
  workloads (named ``default_*``) and two more: a hook function cloning one layer's value per
  step (*read*) and one doing nothing at every layer (*nothing_all*). Both end with a
  TransformerLens notebook's workload: ``run_with_cache`` of every name over 4 prompts of 12
  tokens (*demo_cache*), then ``patching.get_act_patch_resid_pre`` over them (*demo_patch*).
- ``compiled``: plain ``vllm.LLM`` in vLLM's default mode (torch.compile + CUDA graphs on GPU),
  prefix caching off, in-process like vlens.
- ``graph_1`` / ``graph_all``: vlens's compiled engine (names traced into
  vLLM's graph): one layer's ``hook_resid_post`` declared for capture and steering, or every
  layer's for capture; *idle* is that engine's ``vllm.LLM.generate`` with no vlens request (the
  traced copies still run), *cache* ``run_with_cache`` (the cache on the CPU, and on a GPU also
  with ``device="cuda"``: kept where it was captured, on one rank), *generate* vlens's
  ``generate`` asking for nothing (the cost of vlens's call path alone), *steer* ``generate``
  with a different vector per prompt (``Steer`` values).
- ``hooks``: a compiled engine with every layer's ``hook_resid_post`` in ``compiled_hooks``
  (TransformerLens hook functions inside the graph): *idle* is its ``vllm.LLM.generate`` with no
  vlens request, *steer* ``generate`` with one shared hook function adding a vector at one layer,
  *read* one cloning that layer's value at every step, *nothing_all* one doing nothing at every
  layer. ``hooks_1``: the same with only that one layer declared (no *nothing_all*).
- ``hf``: HuggingFace transformers with forward hooks, prefill only (batches of ``hf_batch``):
  no hook, one layer's residual cloned, every layer's.
- ``transformer_lens``: TransformerLens's ``TransformerBridge`` on HuggingFace (compatibility
  mode, no weight processing) doing the same caches and the same steered generation.

``--executor mp`` gives every engine vLLM's multiprocessing executor (on one GPU its worker is
then a process of its own, as every rank is under tensor parallelism).

Two tiers: *prefill* (each prompt once, one token sampled; tokens/s = prompt tokens) and
*generate* (``new_tokens`` per prompt; tokens/s = generated tokens). Every workload's tokens/s
is divided by plain eager vLLM's (the eager engine's *plain*) and by plain compiled vLLM's (the
``compiled`` worker) of the same tier in the same run; the eager tier reads against the first,
the compiled engine against the second. Both ratios are written with the exact command to
``OUT_DIR/results.json`` and ``OUT_DIR/results.md``. ``--profile`` adds cProfile listings of the
vlens workloads (shorter generations) to ``OUT_DIR/profile.txt``.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import io
import json
import os
import pstats
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: The H200 workload (Qwen3-8B's shape, dummy weights).
GPU_PRESET: dict[str, Any] = {
    "model": "dummy-qwen3-8b",
    "dtype": "bfloat16",
    "prompts": 256,
    "prompt_len": 128,
    "new_tokens": 128,
    "layer": 18,
    "sae_features": 65536,
    "hf_batch": 32,
    "profile_new_tokens": 32,
    "engine": {
        "load_format": "dummy",
        "skip_tokenizer_init": True,
        "max_model_len": 1024,
        "max_num_seqs": 256,
        # every prompt's prefill in one step, which a hook function shared by the call's prompts
        # needs (it sees them as TransformerLens's batch); the same for every engine
        "max_num_batched_tokens": 256 * 128,
        # fixed, so that every engine gets the same KV cache and vlens's captures have room
        "kv_cache_memory_bytes": 24 << 30,
        "gpu_memory_utilization": 0.5,
    },
}

PRESETS: dict[str, dict[str, Any]] = {
    "gpu": GPU_PRESET,
    # Llama-3-8B's shape: a second model shape for the two-GPU runs
    "gpu-llama": {**GPU_PRESET, "model": "dummy-llama3-8b", "layer": 16},
    "gpu-short": {**GPU_PRESET, "model": "dummy-qwen3-8b-v49k"},
    "cpu": {
        "model": "smollm2",
        "dtype": "float32",
        "prompts": 64,
        "prompt_len": 128,
        "new_tokens": 64,
        "layer": 15,
        "sae_features": 4608,
        "hf_batch": 8,
        "profile_new_tokens": 8,
        # every prompt's prefill in one step (see the GPU preset)
        "engine": {"max_model_len": 512, "max_num_batched_tokens": 64 * 128},
    },
    # a random Qwen3-shaped model of ~0.3 B parameters, fp32, on the CPU (a smaller workload:
    # the model is twice SmolLM2's size)
    "cpu-qwen3": {
        "model": "random-qwen3-300m",
        "dtype": "float32",
        "prompts": 32,
        "prompt_len": 64,
        "new_tokens": 32,
        "layer": 8,
        "sae_features": 8192,
        "hf_batch": 8,
        "profile_new_tokens": 8,
        "engine": {"max_model_len": 512},
    },
    # a seconds-long check of this script itself (tiny random Qwen3), not a measurement
    "smoke": {
        "model": "tiny-qwen3",
        "dtype": "float32",
        "prompts": 4,
        "prompt_len": 8,
        "new_tokens": 4,
        "layer": 1,
        "sae_features": 256,
        "hf_batch": 2,
        "profile_new_tokens": 2,
        "engine": {"max_model_len": 256},
    },
}

#: Qwen3-8B's shape (its config.json, weights left to vLLM's dummy loader).
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "rope_scaling": None,
    "hidden_act": "silu",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "initializer_range": 0.02,
}


#: Llama-3-8B's shape (its config.json, weights left to vLLM's dummy loader).
LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "initializer_range": 0.02,
}

#: The presets' model shapes with dummy weights, and the tiny checkpoint of the same family whose
#: tokenizer they borrow.
DUMMY_SHAPES = {
    "dummy-qwen3-8b": (QWEN3_8B, "qwen3"),
    "dummy-llama3-8b": (LLAMA3_8B, "llama"),
    # a shorter step: Qwen3-8B's shape with a 49,152-token vocabulary, which shows per-step costs
    "dummy-qwen3-8b-v49k": ({**QWEN3_8B, "vocab_size": 49152}, "qwen3"),
}


#: A Qwen3 of ~0.3 B parameters (16 layers, d_model 1024, GQA 16/8 heads of 64, d_mlp 3072,
#: vocab 32,000): random weights, written once to disk so that HuggingFace and TransformerLens
#: load the same ones.
QWEN3_300M = {
    **{k: v for k, v in QWEN3_8B.items() if k not in ("torch_dtype",)},
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 16,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "torch_dtype": "float32",
}


def random_checkpoint(config: dict[str, Any], folder: Path) -> Path:
    """A seeded random checkpoint of ``config``, with the tiny qwen3 tokenizer, built once."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from vlens.testing.tiny import tiny_model

    if not (folder / "model.safetensors").exists():
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(config, indent=1))
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
        model.to(torch.float32).save_pretrained(folder)
        for file in tiny_model("qwen3").iterdir():
            if file.name.startswith(("tokenizer", "special_tokens")):
                shutil.copy(file, folder / file.name)
    return folder


def model_folder(preset: dict[str, Any], work: Path) -> Path:
    """The checkpoint folder: SmolLM2 (CPU), or an 8B-shaped config (:data:`DUMMY_SHAPES`) with
    the tiny checkpoint's tokenizer of its family (vlens loads a tokenizer; vLLM skips it and
    gets token ids)."""
    from vlens.testing.tiny import tiny_model

    if preset["model"] == "smollm2":
        from vlens.testing.embedded import smollm2_path

        return smollm2_path()
    if preset["model"] == "tiny-qwen3":
        return tiny_model("qwen3")
    if preset["model"] == "random-qwen3-300m":
        return random_checkpoint(QWEN3_300M, work / "random-qwen3-300m")

    config, family = DUMMY_SHAPES[preset["model"]]
    folder = work / f"{preset['model'].removeprefix('dummy-')}-shape"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    for file in tiny_model(family).iterdir():
        if file.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(file, folder / file.name)
    return folder


def prompts_for(preset: dict[str, Any], vocab: int) -> list[list[int]]:
    import torch

    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(100, min(vocab, 100_000), (preset["prompts"], preset["prompt_len"]),
                        generator=generator)
    return ids.tolist()


class Timer:
    """Times workloads and saves every result as soon as it is measured (a worker that runs
    out of time still leaves what it measured)."""

    def __init__(self, save_to: Path, reps: int, skip: set[str] = frozenset()) -> None:
        self.save_to = save_to
        self.reps = reps
        self.skip = skip  # WORKLOAD_TIER names not to run (``--skip``)
        self.results: list[dict[str, Any]] = []
        self.meta: dict[str, Any] = {}

    def save(self) -> None:
        self.save_to.write_text(json.dumps({"meta": self.meta, "results": self.results}))

    def skips(self, workload: str, tier: str) -> bool:
        """Whether ``--skip`` names this workload of this tier."""
        return f"{workload}_{tier}" in self.skip

    def measure(self, workload: str, tier: str, run, **extra: Any) -> int | None:
        import torch

        if self.skips(workload, tier):
            return None
        try:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            start = time.perf_counter()
            tokens = run()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            seconds = time.perf_counter() - start
        except Exception as error:
            print(f"[bench] {workload} {tier} failed: {error!r}", flush=True)
            self.results.append({"workload": workload, "tier": tier, "error": repr(error)})
            self.save()
            return None
        self.results.append(
            {"workload": workload, "tier": tier, "tokens": tokens, "seconds": seconds, **extra}
        )
        self.save()
        print(f"[bench] {workload:18s} {tier:8s} {tokens:7d} tok {seconds:8.3f} s "
              f"{tokens / seconds:10.1f} tok/s", flush=True)
        return tokens


# ---- workers (one process each) ----------------------------------------------------------------


def record_runner(timer: Timer, llm: Any) -> None:
    """Which of vLLM's model runners the engine uses, for the results' header."""
    from vlens.runtime.steps.layout import runner_kind

    executor = llm.llm_engine.model_executor
    if not hasattr(executor, "driver_worker"):  # worker processes (tensor parallelism)
        timer.meta["runner"] = f"{type(executor).__name__}, workers in their own processes"
        return
    runner = executor.driver_worker.worker.model_runner
    timer.meta["runner"] = f"{runner_kind(runner).upper()} ({type(runner).__module__})"


def write_profile(profile: Path, n_prompts: int, new: int,
                  runs: tuple[tuple[str, Callable[[], Any]], ...]) -> None:
    """Append cProfile listings of ``runs`` (label, call) to ``profile``."""
    with profile.open("a") as out:
        for label, run in runs:
            profiler = cProfile.Profile()
            start = time.perf_counter()
            profiler.runcall(run)
            seconds = time.perf_counter() - start
            text = io.StringIO()
            stats = pstats.Stats(profiler, stream=text)
            stats.sort_stats("tottime").print_stats(25)
            stats.sort_stats("cumulative").print_stats(40)
            out.write(f"\n===== {label}: {n_prompts} prompts x {new} new tokens, "
                      f"{seconds:.2f} s under cProfile =====\n{text.getvalue()}")


def worker_eager(
    preset: dict[str, Any], path: Path, timer: Timer, profile: Path | None,
    kind: str = "eager",
) -> None:
    """vlens's eager engine (``enforce_eager=True``), or with ``kind="default"`` the engine
    ``from_pretrained(path)`` gives with no declaration (on a GPU: compiled, hook functions at
    every name), its workloads' names then prefixed ``default_``, and two more: a hook
    function cloning one layer per step (*read*) and one doing nothing at every layer."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from vlens import HookedVLLM

    eager = {"enforce_eager": True} if kind == "eager" else {}
    start = time.perf_counter()
    model = HookedVLLM.from_pretrained(path, dtype=preset["dtype"], **eager, **engine_args(preset))
    timer.meta[f"{kind}_load_s"] = round(time.perf_counter() - start, 1)
    if kind != "eager":
        timer = Prefixed(timer, f"{kind}_")
    llm = model.engine.llm
    record_runner(timer, llm)
    prompts = prompts_for(preset, model.cfg.d_vocab)
    n_prompt = sum(len(p) for p in prompts)
    new = preset["new_tokens"]
    layer = preset["layer"]
    one = f"blocks.{layer}.hook_resid_post"
    every = [f"blocks.{i}.hook_resid_post" for i in range(model.cfg.n_layers)]
    # every name of the layer that the steering vector goes into; patterns are [head q k]
    # per prompt, the rest [pos ...]
    one_layer = [name for name in model.hook_names if name.startswith(f"blocks.{layer}.")]
    import torch

    vector = torch.randn(model.cfg.d_model, generator=torch.Generator().manual_seed(1))
    on_device: dict[str, torch.Tensor] = {}

    def steer(x, hook):
        key = f"{x.device}{x.dtype}"
        if key not in on_device:
            on_device[key] = vector.to(x.device, x.dtype)
        return x + on_device[key]

    def plain(max_tokens: int, ignore_eos: bool) -> int:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos)
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                               use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outputs)

    def cache(names: list[str], max_new: int) -> int:
        _, c = model.run_with_cache(prompts, names_filter=names, return_type=None,
                                    max_new_tokens=max_new)
        if names is every and not max_new:
            timer.meta["cache_all_prefill_bytes"] = sum(
                c[name].numel() * c[name].element_size() for name in c.keys()
            )
        return int(c.lengths.sum()) - n_prompt + len(prompts) if max_new else n_prompt

    def hooked(max_new: int, hooks: list) -> int:
        out = model.generate(prompts, max_new_tokens=max_new, do_sample=False, stop_at_eos=False,
                             fwd_hooks=hooks, return_type="input")
        return sum(len(o) for o in out) - n_prompt

    def steered(max_new: int) -> int:
        return hooked(max_new, [(one, steer)])

    read: list[torch.Tensor] = []

    def look(x, hook):
        if len(read) > 256:
            read.clear()
        read.append(x.clone())

    def nothing(x, hook):
        return None

    # warm-up: kernels, the hook path, the sampler
    few = prompts[:8]
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in few],
                 SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    model.run_with_cache(few, names_filter=[one], return_type=None, max_new_tokens=2)
    model.generate(few, max_new_tokens=2, do_sample=False, fwd_hooks=[(one, steer)])

    full = True
    for rep in range(timer.reps):
        timer.measure("plain", "prefill", lambda: (plain(1, True), n_prompt)[1], rep=rep)
        timer.measure("cache_1", "prefill", lambda: cache([one], 0), rep=rep)
        timer.measure("cache_all", "prefill", lambda: cache(every, 0), rep=rep)
        timer.measure("cache_layer_names", "prefill", lambda: cache(one_layer, 0), rep=rep)
        got = timer.measure("plain", "generate", lambda: plain(new, False), rep=rep)
        full = got is None or got == new * len(prompts)
        if not full:  # EOS met: steering runs with ignore_eos, so measure plain that way too
            timer.measure("plain_ignore_eos", "generate", lambda: plain(new, True), rep=rep)
        timer.measure("cache_1", "generate", lambda: cache([one], new), rep=rep)
        timer.measure("steer", "generate", lambda: steered(new), rep=rep)
        if kind != "eager":
            timer.measure("read", "generate", lambda: hooked(new, [(one, look)]), rep=rep)
            timer.measure("nothing_all", "generate",
                          lambda: hooked(new, [(name, nothing) for name in every]), rep=rep)
    timer.measure("plain", "generate", lambda: plain(new, False), rep=timer.reps)
    demo(model, prompts, timer)

    if profile is not None:
        short = preset["profile_new_tokens"]
        write_profile(profile, len(prompts), short, (
            ("plain generate", lambda: plain(short, False)),
            ("cache_1 generate", lambda: cache([one], short)),
            ("steer generate", lambda: steered(short)),
            ("nothing_all generate", lambda: hooked(short, [(n, nothing) for n in every])),
            ("cache_all generate", lambda: cache(every, short)),
        ))
    # last: the heaviest (every layer, every step), so that running out of time loses only it;
    # its first call pins its host memory (19 GB on the GPU preset), which later calls reuse
    if not timer.skips("cache_all", "generate"):
        start = time.perf_counter()
        cache(every, new)
        timer.meta[f"{kind}_cache_all_generate_first_s"] = round(time.perf_counter() - start, 2)
        for rep in range(timer.reps):
            timer.measure("cache_all", "generate", lambda: cache(every, new), rep=rep)
    timer.meta["peak_rss_bytes_eager_worker"] = peak_rss_bytes()


def demo(model: Any, prompts: list[list[int]], timer: Timer | Prefixed) -> None:
    """A TransformerLens notebook's workload, as its notebooks write it: ``run_with_cache`` of
    every name over a few short prompts (*demo_cache*), then a residual patching sweep over every
    layer and position of them (*demo_patch*: one request per cell and prompt, each with its own
    patching hook), counted in the tokens the engine runs."""
    import torch

    from vlens import patching

    batch, length = DEMO_SHAPE[0], min(DEMO_SHAPE[1], len(prompts[0]))
    clean = torch.tensor([prompt[:length] for prompt in prompts[:batch]])
    corrupted = torch.tensor([prompt[-length:] for prompt in prompts[:batch]])
    clean_cache: list[Any] = [None]

    def cache_every_name() -> int:
        clean_cache[0] = model.run_with_cache(clean)[1]
        return batch * length

    def metric(logits: torch.Tensor) -> torch.Tensor:
        return logits[:, -1, 0].mean()

    def sweep() -> int:
        patching.get_act_patch_resid_pre(model, corrupted, clean_cache[0], metric)
        return model.cfg.n_layers * length * batch * length

    for rep in range(timer.reps):
        if timer.measure("demo_cache", "prefill", cache_every_name, rep=rep) is not None:
            timer.measure("demo_patch", "prefill", sweep, rep=rep)


#: A TransformerLens demo's batch: prompts and tokens each (:func:`demo`).
DEMO_SHAPE = (4, 12)


class Prefixed:
    """A timer whose workloads' names carry ``prefix`` (one worker's workloads on another
    engine)."""

    def __init__(self, timer: Timer, prefix: str) -> None:
        self.timer, self.prefix = timer, prefix
        self.reps, self.meta = timer.reps, timer.meta

    def skips(self, workload: str, tier: str) -> bool:
        return self.timer.skips(self.prefix + workload, tier)

    def measure(self, workload: str, *args: Any, **kwargs: Any) -> Any:
        return self.timer.measure(self.prefix + workload, *args, **kwargs)


def vlens_engine(preset: dict[str, Any], path: Path, timer: Timer, **declared: Any) -> tuple:
    """A vlens engine with ``declared`` compiled names, its ``vllm.LLM``, the preset's prompts
    and their number of tokens."""
    from vlens import HookedVLLM

    model = HookedVLLM.from_pretrained(path, dtype=preset["dtype"], **declared,
                                       **engine_args(preset))
    llm = model.engine.llm
    record_runner(timer, llm)
    prompts = prompts_for(preset, model.cfg.d_vocab)
    return model, llm, prompts, sum(len(p) for p in prompts)


def plain_tokens(llm: Any, prompts: list[list[int]], max_tokens: int) -> int:
    """The tokens ``llm.generate`` makes with no vlens request (greedy, ``ignore_eos``)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                           use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outputs)


def worker_graph(preset: dict[str, Any], path: Path, timer: Timer, every_layer: bool) -> None:
    """vlens's compiled engine, with one layer's ``hook_resid_post`` declared for
    capture and steering (``graph_1``), or every layer's for capture (``graph_all``)."""
    import torch

    from vlens import Steer

    n_layers = json.loads((path / "config.json").read_text())["num_hidden_layers"]
    one = f"blocks.{preset['layer']}.hook_resid_post"
    every = [f"blocks.{i}.hook_resid_post" for i in range(n_layers)]
    declared = {"compiled_capture": every} if every_layer else {
        "compiled_capture": [one], "compiled_steering": [one]}
    model, llm, prompts, n_prompt = vlens_engine(preset, path, timer, **declared)
    new = preset["new_tokens"]
    generator = torch.Generator().manual_seed(1)
    vectors = [torch.randn(model.cfg.d_model, generator=generator) for _ in prompts]

    def plain(max_tokens: int) -> int:
        return plain_tokens(llm, prompts, max_tokens)

    def cache(names: list[str], max_new: int, device: str | None = None) -> int:
        _, c = model.run_with_cache(prompts, names_filter=names, return_type=None,
                                    max_new_tokens=max_new, device=device)
        return int(c.lengths.sum()) - n_prompt + len(prompts) if max_new else n_prompt

    def generated(max_new: int, **asked: Any) -> int:
        out = model.generate(prompts, max_new_tokens=max_new, do_sample=False, stop_at_eos=False,
                             return_type="input", **asked)
        return sum(len(o) for o in out) - n_prompt

    def steered(max_new: int) -> int:
        per_prompt = [[Steer(one, add=vector)] for vector in vectors]  # one vector per request
        return generated(max_new, prompt_steering=per_prompt)

    few = prompts[:8]
    model.run_with_cache(few, names_filter=[one], return_type=None, max_new_tokens=2)
    # device="cuda" is refused under tensor parallelism (the rows come through another process),
    # and measured only where the worker runs in this process
    on_gpu = torch.cuda.is_available() and model.engine.in_process
    names = every if every_layer else [one]
    kind = "graph_all" if every_layer else "graph_1"
    if every_layer:  # the host memory of both calls' caches, pinned once (10-20 s on an H200)
        cache(names, 0)
        cache(names, new)
    for rep in range(timer.reps):
        timer.measure(f"{kind}_idle", "prefill", lambda: (plain(1), n_prompt)[1], rep=rep)
        timer.measure(f"{kind}_cache", "prefill", lambda: cache(names, 0), rep=rep)
        if on_gpu:
            timer.measure(f"{kind}_cache_gpu", "prefill", lambda: cache(names, 0, "cuda"), rep=rep)
        timer.measure(f"{kind}_idle", "generate", lambda: plain(new), rep=rep)
        if on_gpu:
            timer.measure(f"{kind}_cache_gpu", "generate", lambda: cache(names, new, "cuda"), rep=rep)
        timer.measure(f"{kind}_cache", "generate", lambda: cache(names, new), rep=rep)
        if not every_layer:
            timer.measure("graph_1_generate", "generate", lambda: generated(new), rep=rep)
            timer.measure("graph_1_steer", "generate", lambda: steered(new), rep=rep)


def worker_hooks(
    preset: dict[str, Any], path: Path, timer: Timer, profile: Path | None, kind: str
) -> None:
    """TransformerLens hook functions on a compiled engine: every layer's ``hook_resid_post``
    declared in ``compiled_hooks`` (``hooks``), one layer's (``hooks_1``) or every name
    (``hooks_every``); nothing registered, one shared steering function at one layer, one
    function reading one layer, and (every layer declared) a function that does nothing at every
    layer. The engine's load time goes into the results' header."""
    import torch

    n_layers = json.loads((path / "config.json").read_text())["num_hidden_layers"]
    one = f"blocks.{preset['layer']}.hook_resid_post"
    every = [f"blocks.{i}.hook_resid_post" for i in range(n_layers)]
    declared = {"hooks": every, "hooks_1": [one], "hooks_every": lambda name: True}[kind]
    start = time.perf_counter()
    model, llm, prompts, n_prompt = vlens_engine(preset, path, timer, compiled_hooks=declared)
    timer.meta[f"{kind}_load_s"] = round(time.perf_counter() - start, 1)
    every_layer = kind != "hooks_1"
    new = preset["new_tokens"]
    vector = torch.randn(model.cfg.d_model, generator=torch.Generator().manual_seed(1))
    read: list[torch.Tensor] = []

    def plain(max_tokens: int) -> int:
        return plain_tokens(llm, prompts, max_tokens)

    on_device: dict[str, torch.Tensor] = {}

    def steer(x, hook):  # the vector moved to the GPU once, as a user's hook would hold it
        key = f"{x.device}{x.dtype}"
        if key not in on_device:
            on_device[key] = vector.to(x.device, x.dtype)
        return x + on_device[key]

    def look(x, hook):
        read.append(x.clone())

    def nothing(x, hook):
        return None

    def generated(max_new: int, hooks: list) -> int:
        read.clear()
        out = model.generate(prompts, max_new_tokens=max_new, do_sample=False, stop_at_eos=False,
                             return_type="input", fwd_hooks=hooks)
        return sum(len(o) for o in out) - n_prompt

    generated(2, [(one, steer)])
    for rep in range(timer.reps):
        timer.measure(f"{kind}_idle", "generate", lambda: plain(new), rep=rep)
        timer.measure(f"{kind}_steer", "generate", lambda: generated(new, [(one, steer)]), rep=rep)
        timer.measure(f"{kind}_read", "generate", lambda: generated(new, [(one, look)]), rep=rep)
        if every_layer:
            timer.measure(f"{kind}_nothing_all", "generate",
                          lambda: generated(new, [(name, nothing) for name in every]), rep=rep)
    if profile is not None:
        short = preset["profile_new_tokens"]
        runs = [(f"{kind} steer generate", lambda: generated(short, [(one, steer)])),
                (f"{kind} read generate", lambda: generated(short, [(one, look)]))]
        if every_layer:
            runs.append((f"{kind} nothing at every layer",
                         lambda: generated(short, [(name, nothing) for name in every])))
        write_profile(profile, len(prompts), short, tuple(runs))


def bench_sae(preset: dict[str, Any], d_model: int) -> Any:
    """A random standard SAE at the preset's layer's ``hook_resid_post`` (``sae_features``
    features, the preset's dtype), built in memory: its speed, not its features, is measured."""
    import torch

    from vlens.sae import SAE, SAEConfig

    d_sae = preset["sae_features"]
    cfg = SAEConfig("standard", d_model, d_sae, dtype=preset["dtype"],
                    hook_name=f"blocks.{preset['layer']}.hook_resid_post")
    generator = torch.Generator().manual_seed(7)
    w_dec = torch.randn(d_sae, d_model, generator=generator) / d_model**0.5
    weights = {"W_enc": w_dec.T.contiguous(), "W_dec": w_dec, "b_dec": torch.zeros(d_model),
               "b_enc": -0.1 * torch.ones(d_sae)}
    return SAE(cfg, weights).eval()


def worker_saes(preset: dict[str, Any], path: Path, timer: Timer, kind: str) -> None:
    """An SAE of ``sae_features`` features at one layer: ``sae_steer``, declared in the graph
    (``compiled_saes``) and one feature clamped per request (a different feature each);
    ``sae_top_k``, declared with its top-64 features captured, read over the prefill;
    ``sae_splice``, spliced in whole with ``add_sae`` at a ``compiled_hooks`` name (its
    reconstruction replaces the activation) in generation."""
    from vlens import SAESteer

    d_model = json.loads((path / "config.json").read_text())["hidden_size"]
    sae = bench_sae(preset, d_model)
    one = sae.cfg.hook_name
    declared: dict[str, Any] = {
        "sae_steer": {"compiled_saes": {"res": sae}},
        "sae_top_k": {"compiled_saes": {"res": sae}, "compiled_sae_top_k": 64},
        "sae_splice": {"compiled_hooks": [one]},
    }[kind]
    model, llm, prompts, n_prompt = vlens_engine(preset, path, timer, **declared)
    new = preset["new_tokens"]

    def plain(max_tokens: int) -> int:
        return plain_tokens(llm, prompts, max_tokens)

    def generated(max_new: int, **asked: Any) -> int:
        out = model.generate(prompts, max_new_tokens=max_new, do_sample=False, stop_at_eos=False,
                             return_type="input", **asked)
        return sum(len(o) for o in out) - n_prompt

    clamps = [[SAESteer("res", features=[(97 * i + 5) % sae.cfg.d_sae], clamp=8.0)]
              for i in range(len(prompts))]
    top_k = [f"{one}.hook_sae_acts_post.top_k_values", f"{one}.hook_sae_acts_post.top_k_indices"]

    def captured() -> int:
        _, cache = model.run_with_cache(prompts, names_filter=top_k, return_type=None)
        return int(cache.lengths.sum())

    if kind == "sae_splice":
        model.add_sae(sae)
    generated(2)
    for rep in range(timer.reps):
        timer.measure(f"{kind}_idle", "generate", lambda: plain(new), rep=rep)
        if kind == "sae_steer":
            timer.measure("sae_steer_clamp", "generate",
                          lambda: generated(new, prompt_steering=clamps), rep=rep)
        elif kind == "sae_top_k":
            timer.measure(f"{kind}_idle", "prefill", lambda: (plain(1), n_prompt)[1], rep=rep)
            timer.measure("sae_top_k_capture", "prefill", captured, rep=rep)
        else:
            timer.measure("sae_splice_generate", "generate", lambda: generated(new), rep=rep)


def engine_args(preset: dict[str, Any]) -> dict[str, Any]:
    """Every engine's arguments: the preset's, prefix caching off (every repetition sends the
    same prompts, which a prefix cache would serve from the second on)."""
    return {**preset["engine"], "enable_prefix_caching": False}


def peak_rss_bytes() -> int:
    """The process's peak resident memory (engine, KV cache and every cache it returned)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def worker_compiled(
    preset: dict[str, Any], path: Path, timer: Timer, piecewise: bool = False
) -> None:
    """Plain compiled vLLM in its default CUDA graph mode; ``piecewise``: with
    ``cudagraph_mode=PIECEWISE``, the mode of any step in which a hook function runs (attention
    eager between captured pieces), the ceiling of those steps."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    engine = engine_args(preset)
    if piecewise:
        engine["compilation_config"] = {"cudagraph_mode": "PIECEWISE"}
    kind = "compiled_piecewise" if piecewise else "compiled"
    start = time.perf_counter()
    llm = LLM(model=str(path), dtype=preset["dtype"], enforce_eager=False, **engine)
    timer.meta[f"{kind}_load_s"] = round(time.perf_counter() - start, 1)
    from transformers import AutoConfig

    prompts = prompts_for(preset, AutoConfig.from_pretrained(path).vocab_size)
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    n_prompt = sum(len(p) for p in prompts)

    def plain(max_tokens: int, ignore_eos: bool) -> int:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos)
        outputs = llm.generate(inputs, params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outputs)

    plain(4, False)
    for rep in range(timer.reps):
        timer.measure(kind, "prefill", lambda: (plain(1, True), n_prompt)[1], rep=rep)
        timer.measure(kind, "generate", lambda: plain(preset["new_tokens"], False), rep=rep)


def worker_hf(preset: dict[str, Any], path: Path, timer: Timer) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = getattr(torch, preset["dtype"])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if preset["model"] not in DUMMY_SHAPES:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    else:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype)
    model.eval()
    layers = model.model.layers
    prompts = torch.tensor(prompts_for(preset, model.config.vocab_size), device=device)
    batch = preset["hf_batch"]
    kept: list[torch.Tensor] = []

    def keep(_module, _args, output):
        value = output[0] if isinstance(output, tuple) else output
        kept.append(value.detach().clone().to("cpu", non_blocking=True))

    @torch.no_grad()
    def run(hooked: list[int]) -> int:
        handles = [layers[i].register_forward_hook(keep) for i in hooked]
        try:
            for start in range(0, len(prompts), batch):
                model(prompts[start : start + batch], logits_to_keep=1)
            if device == "cuda":
                torch.cuda.synchronize()
        finally:
            for handle in handles:
                handle.remove()
            kept.clear()
        return prompts.numel()

    run([preset["layer"]])
    for rep in range(timer.reps):
        timer.measure("hf", "prefill", lambda: run([]), rep=rep)
        timer.measure("hf_cache_1", "prefill", lambda: run([preset["layer"]]), rep=rep)
        timer.measure("hf_cache_all", "prefill", lambda: run(list(range(len(layers)))), rep=rep)


def worker_transformer_lens(preset: dict[str, Any], path: Path, timer: Timer) -> None:
    """TransformerLens's ``TransformerBridge`` on HuggingFace (compatibility mode, no weight
    processing), doing the same cache (one layer, every layer) and the same steered generation."""
    import torch
    from transformer_lens.model_bridge import TransformerBridge

    device = "cuda" if torch.cuda.is_available() else "cpu"
    bridge = TransformerBridge.boot_transformers(
        str(path), dtype=getattr(torch, preset["dtype"]), device=device
    )
    bridge.enable_compatibility_mode(no_processing=True)
    prompts = torch.tensor(prompts_for(preset, bridge.cfg.d_vocab), device=device)
    batch, layer, new = preset["hf_batch"], preset["layer"], preset["new_tokens"]
    one = f"blocks.{layer}.hook_resid_post"
    every = [f"blocks.{i}.hook_resid_post" for i in range(bridge.cfg.n_layers)]
    vector = torch.randn(bridge.cfg.d_model, generator=torch.Generator().manual_seed(1)).to(device)

    @torch.no_grad()
    def cache(names: list[str]) -> int:
        for start in range(0, len(prompts), batch):
            bridge.run_with_cache(prompts[start : start + batch], names_filter=names)
        return prompts.numel()

    @torch.no_grad()
    def steered() -> int:
        with bridge.hooks(fwd_hooks=[(one, lambda x, hook: x + vector)]):
            for start in range(0, len(prompts), batch):
                bridge.generate(prompts[start : start + batch], max_new_tokens=new,
                                do_sample=False, stop_at_eos=False, verbose=False)
        return new * len(prompts)

    cache([one])
    for rep in range(timer.reps):
        timer.measure("tl_cache_1", "prefill", lambda: cache([one]), rep=rep)
        timer.measure("tl_cache_all", "prefill", lambda: cache(every), rep=rep)
    timer.measure("tl_steer", "generate", steered, rep=0)


# ---- the orchestrating process -----------------------------------------------------------------

WORKERS = ("eager", "default", "compiled", "compiled_piecewise", "graph_1", "graph_all", "hooks", "hooks_1",
           "hooks_every", "hf",
           "transformer_lens", "sae_steer", "sae_top_k", "sae_splice")


#: Seconds each worker may take (``--timeouts`` overrides), so that one run ends in time.
TIMEOUTS = {"eager": 300, "default": 400, "compiled": 150, "compiled_piecewise": 150, "graph_1": 300, "graph_all": 300, "hooks": 300,
            "hooks_1": 300, "hooks_every": 400, "hf": 80,
            "transformer_lens": 300, "sae_steer": 300, "sae_top_k": 300, "sae_splice": 300}


def run_worker(name: str, args: argparse.Namespace, path: Path) -> dict[str, Any]:
    result = args.work / f"{name}.json"
    result.unlink(missing_ok=True)
    command = [sys.executable, __file__, "--worker", name, "--preset", args.preset, "--out",
               str(args.out), "--work", str(args.work), "--model-path", str(path), "--reps",
               str(args.reps)]
    if args.profile:
        command.append("--profile")
    if args.skip:
        command += ["--skip", args.skip]
    if args.tensor_parallel_size > 1:
        command += ["--tensor-parallel-size", str(args.tensor_parallel_size)]
    if args.executor:
        command += ["--executor", args.executor]
    env = dict(os.environ)
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    print(f"[bench] worker {name}: {' '.join(command)}", flush=True)
    start = time.time()
    try:
        code = subprocess.call(command, env=env, timeout=args.timeouts[name])
    except subprocess.TimeoutExpired:
        code = "timeout"
    print(f"[bench] worker {name} exit {code} after {time.time() - start:.0f} s", flush=True)
    return json.loads(result.read_text()) if result.exists() else {"meta": {}, "results": []}


def summarise(results: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    """The best time of each (workload, tier), with its tokens/s."""
    best: dict[tuple[str, str], dict[str, Any]] = {}
    for r in results:
        if "error" in r:
            continue
        key = (r["workload"], r["tier"])
        rate = r["tokens"] / r["seconds"]
        if key not in best or rate > best[key]["tok_s"]:
            best[key] = {**r, "tok_s": rate}
    return best


LABELS = {
    "plain": "plain vLLM, eager (vlens's engine, no vlens request)",
    "plain_ignore_eos": "plain vLLM, eager, ignore_eos",
    "cache_1": "vlens run_with_cache, one layer's resid_post",
    "cache_all": "vlens run_with_cache, every layer's resid_post",
    "steer": "vlens generate, one steering vector at one layer",
    "default_plain": "vlens default engine (no declaration), no vlens request",
    "default_cache_1": "vlens default engine: run_with_cache, one layer's resid_post",
    "default_cache_all": "vlens default engine: run_with_cache, every layer's resid_post",
    "default_cache_layer_names": "vlens default engine: run_with_cache, every name of one layer",
    "default_steer": "vlens default engine: generate, a hook function steering one layer",
    "default_read": "vlens default engine: generate, a hook function cloning one layer",
    "default_nothing_all": "vlens default engine: generate, a no-op hook at every layer",
    "compiled": "plain vLLM, default mode (compiled + CUDA graphs on GPU)",
    "compiled_piecewise": "plain vLLM, compiled, cudagraph_mode=PIECEWISE (steps with a hook)",
    "hf": "HuggingFace forward, no hook",
    "hf_cache_1": "HuggingFace forward, hook cloning one layer's residual",
    "hf_cache_all": "HuggingFace forward, hooks cloning every layer's residual",
    "cache_layer_names": "vlens run_with_cache, every name of one layer",
    "graph_1_idle": "vlens compiled engine (one layer declared), no vlens request",
    "graph_1_cache": "vlens compiled: run_with_cache, one layer's resid_post (cache on the CPU)",
    "graph_1_cache_gpu": "vlens compiled: run_with_cache, one layer's resid_post, device='cuda'",
    "graph_1_generate": "vlens compiled: generate, nothing asked (vlens's call alone)",
    "graph_1_steer": "vlens compiled: generate, a steering vector per request at one layer",
    "graph_all_idle": "vlens compiled engine (every layer declared), no vlens request",
    "graph_all_cache": "vlens compiled: run_with_cache, every layer's resid_post (on the CPU)",
    "graph_all_cache_gpu": "vlens compiled: run_with_cache, every layer's resid_post, "
    "device='cuda'",
    "hooks_idle": "vlens compiled, every layer in compiled_hooks, no vlens request",
    "hooks_steer": "vlens compiled_hooks: generate, a hook function steering one layer",
    "hooks_read": "vlens compiled_hooks: generate, a hook function cloning one layer per step",
    "hooks_nothing_all": "vlens compiled_hooks: generate, a hook doing nothing at every layer",
    "hooks_every_idle": "vlens compiled, every name in compiled_hooks, no vlens request",
    "hooks_every_steer": "vlens, every name declared: generate, a hook function steering one layer",
    "hooks_every_read": "vlens, every name declared: generate, a hook function cloning one layer",
    "hooks_every_nothing_all": "vlens, every name declared: generate, a no-op hook at every layer",
    "hooks_1_idle": "vlens compiled, one layer in compiled_hooks, no vlens request",
    "hooks_1_steer": "vlens compiled_hooks (one layer): generate, a hook function steering it",
    "hooks_1_read": "vlens compiled_hooks (one layer): generate, a hook function cloning it",
    "tl_cache_1": "TransformerLens (TransformerBridge on HF) run_with_cache, one layer",
    "tl_cache_all": "TransformerLens (TransformerBridge on HF) run_with_cache, every layer",
    "tl_steer": "TransformerLens (TransformerBridge on HF) generate, one steering vector",
    "sae_steer_idle": "vlens compiled, an SAE in compiled_saes, no vlens request",
    "sae_steer_clamp": "vlens compiled_saes: generate, one SAE feature clamped per request "
    "(a different feature each)",
    "sae_top_k_idle": "vlens compiled, an SAE in compiled_saes with top-64 capture, no vlens request",
    "sae_top_k_capture": "vlens compiled_saes: run_with_cache, the SAE's top-64 features per token",
    "sae_splice_idle": "vlens compiled, one layer in compiled_hooks, no vlens request",
    "sae_splice_generate": "vlens compiled_hooks + add_sae: generate with the whole SAE spliced in",
}


def memory_lines(meta: dict[str, Any]) -> list[str]:
    """The all-layers cache's memory, where the eager worker measured it."""
    if "cache_all_prefill_bytes" not in meta:
        return []
    return [
        f"Memory: the every-layer `resid_post` cache of the prefill workload holds "
        f"{meta['cache_all_prefill_bytes'] / 2**20:,.0f} MiB; the vlens worker process peaked at "
        f"{meta['peak_rss_bytes_eager_worker'] / 2**30:,.2f} GiB resident (engine, KV cache and "
        f"every cache returned).",
        "",
    ]


def markdown(meta: dict[str, Any], best: dict[tuple[str, str], dict[str, Any]]) -> str:
    lines = [
        f"Run on {meta['date']}: {meta['device']}, vLLM {meta['vllm']}, torch {meta['torch']}, "
        f"model runner {meta['runner']}; {meta['model']} ({meta['dtype']}), {meta['prompts']} "
        f"prompts x {meta['prompt_len']} tokens, {meta['new_tokens']} new tokens, greedy; "
        f"layer {meta['layer']}; best of {meta['reps']}.",
        "",
        f"Command: `{meta['command']}`",
        "",
        *memory_lines(meta),
        *[f"Load ({key.removesuffix('_load_s')}): {value} s" for key, value in meta.items()
          if key.endswith("_load_s")],
        "",
        "| tier | workload | tokens | seconds | tokens/s | ratio to plain eager "
        "| ratio to plain compiled |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for tier in ("prefill", "generate"):
        bases = [best.get((base, tier)) for base in ("plain", "compiled")]
        for (workload, t), r in best.items():
            if t != tier:
                continue
            ratios = [f"{r['tok_s'] / base['tok_s']:.3f}" if base else "-" for base in bases]
            lines.append(f"| {tier} | {LABELS.get(workload, workload)} | {r['tokens']} | "
                         f"{r['seconds']:.3f} | {r['tok_s']:,.0f} | {' | '.join(ratios)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="gpu")
    parser.add_argument("--out", type=Path, default=Path("bench/out"))
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--skip", default="", help="comma-separated workers to leave out ("
                        + ", ".join(WORKERS) + "), or workloads as the results name them, "
                        "WORKLOAD_TIER (cache_all_generate, default_demo_cache_prefill, ...)")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--work", type=Path, default=Path("/tmp/vlens-bench"),
                        help="scratch folder (the dummy checkpoint, workers' results)")
    parser.add_argument("--timeouts", default="",
                        help="per-worker seconds, e.g. eager=300,compiled=150 (defaults: "
                        + ", ".join(f"{k}={v}" for k, v in TIMEOUTS.items()) + ")")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="every vLLM engine (plain and vlens's) on this many GPUs")
    parser.add_argument("--executor", choices=("uni", "mp"),
                        help="vLLM's distributed_executor_backend for every engine (mp on one "
                        "GPU: its worker in a process of its own, as under tensor parallelism)")
    parser.add_argument("--worker", choices=WORKERS, help=argparse.SUPPRESS)
    parser.add_argument("--model-path", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    preset = PRESETS[args.preset]
    if args.tensor_parallel_size > 1:
        preset["engine"] = {**preset["engine"], "tensor_parallel_size": args.tensor_parallel_size}
    if args.executor:
        preset["engine"] = {**preset["engine"], "distributed_executor_backend": args.executor}
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    skip = {s for s in args.skip.split(",") if s}
    args.timeouts = {**TIMEOUTS, **{k: int(v) for k, v in
                                    (item.split("=") for item in args.timeouts.split(",") if item)}}

    if args.worker:
        timer = Timer(args.work / f"{args.worker}.json", args.reps, skip)
        if args.worker in ("eager", "default"):
            profile = args.out / "profile.txt" if args.profile else None
            worker_eager(preset, args.model_path, timer, profile, args.worker)
        elif args.worker in ("compiled", "compiled_piecewise"):
            worker_compiled(preset, args.model_path, timer,
                            piecewise=args.worker == "compiled_piecewise")
        elif args.worker in ("graph_1", "graph_all"):
            worker_graph(preset, args.model_path, timer, every_layer=args.worker == "graph_all")
        elif args.worker in ("hooks", "hooks_1", "hooks_every"):
            profile = args.out / "profile.txt" if args.profile else None
            worker_hooks(preset, args.model_path, timer, profile, args.worker)
        elif args.worker == "transformer_lens":
            worker_transformer_lens(preset, args.model_path, timer)
        elif args.worker.startswith("sae_"):
            worker_saes(preset, args.model_path, timer, args.worker)
        else:
            worker_hf(preset, args.model_path, timer)
        timer.save()
        sys.stdout.flush()
        os._exit(0)  # skip engine teardown: the numbers are saved

    import torch
    import vllm

    path = model_folder(preset, args.work / "model")
    (args.out / "profile.txt").unlink(missing_ok=True)
    results: list[dict[str, Any]] = []
    measured: dict[str, Any] = {"runner": "?"}  # what workers report besides timings
    for name in WORKERS:
        if name not in skip:
            got = run_worker(name, args, path)
            results += got["results"]
            measured.update(got["meta"])
    meta = {
        "date": str(datetime.date.today()),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU",
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        **measured,
        "reps": args.reps,
        "command": " ".join(["python bench/run.py", *(sys.argv[1:] if argv is None else argv)]),
        **{k: v for k, v in preset.items() if k != "engine"},
        "engine": preset["engine"],
    }
    best = summarise(results)
    (args.out / "results.json").write_text(json.dumps({"meta": meta, "results": results},
                                                      indent=1))
    text = markdown(meta, best)
    (args.out / "results.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
