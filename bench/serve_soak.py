"""A bounded soak of ``vlens serve`` under faults, on loopback: many concurrent clients steering,
capturing, disconnecting mid-stream, giving up on requests, never fetching captures, asking for
captures larger than the server holds and guessing activation ids, for ``--minutes``.

Recorded: requests by kind and outcome (an expected refusal, such as the 400 of a capture larger
than the server holds or the 404 of an id fetched twice, counts as served right; a 5xx or a dropped
connection the client did not choose counts as an error; the clients do not retry), whether a
reference request steered and captured alone gives the same tokens and activations all along,
the server's memory (the resident memory of its processes) after warm-up, every 15 s and at the
end, and its status once idle (every worker follows no request, no plan is left, the held captures
within its bound).

    python bench/serve_soak.py [--minutes 3] [--clients 24] [--out bench/out-cpu-soak] [--plain]

``--plain``: every client sends plain completions only (no ``vlens`` field), the same server's
baseline, to tell vLLM's own memory growth from vlens's. The memory is also recorded per process
(the API server, the engine core).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

import httpx
import openai
import torch
from safetensors.torch import load, save_file

from vlens.serve.process import free_port, server_process, status
from vlens.testing.tiny import tiny_model

KEY = "soak"
STEERED = "blocks.1.hook_resid_post"
CAPTURE_BYTES = 256 * 1024
#: Captured per request that captures: about 4 KiB per position (two layers of d_model 128 fp32)
CAPTURED = ["blocks.0.hook_resid_post", STEERED]
#: More than the server holds at any prompt length the model takes
TOO_LARGE = ["blocks.0.hook_resid_post", "blocks.1.hook_resid_post", "blocks.2.hook_resid_post",
             "blocks.0.mlp.hook_post", "blocks.1.mlp.hook_post", "blocks.2.mlp.hook_post"]


def prompt_of(rng: random.Random, length: int | None = None) -> list[int]:
    return [rng.randrange(3, 500) for _ in range(length or rng.randrange(4, 40))]


class Soak:
    def __init__(self, base: str, vector: list[float], keepalive: float | None = None) -> None:
        self.base = base
        self.vector = vector
        self.outcomes: Counter[tuple[str, str]] = Counter()
        self.lock = threading.Lock()
        # keepalive: how long the shared client keeps an idle connection for reuse (httpx's
        # default, 5 s, is the server's own keep-alive timeout: a connection reused just as the
        # server closes it is lost without an answer)
        pooled = httpx.Client(limits=httpx.Limits(keepalive_expiry=keepalive)) if keepalive else None
        self.client = openai.OpenAI(base_url=base, api_key=KEY, max_retries=0, timeout=120,
                                    http_client=pooled)
        self.reference = self.solo_reference()

    def count(self, kind: str, outcome: str) -> None:
        with self.lock:
            self.outcomes[kind, outcome] += 1

    def complete(self, prompt: list[int], vlens: dict | None, **options) -> object:
        body = {"ignore_eos": True, "return_token_ids": True, **({"vlens": vlens} if vlens else {})}
        options = {"model": str(tiny_model("llama")), "max_tokens": 8, "temperature": 0.0, **options}
        client = options.pop("client", self.client)
        return client.completions.create(prompt=prompt, **options, extra_body=body)

    def fetch(self, activation_id: str) -> bytes:
        request = urllib.request.Request(f"{self.base}/activations/{activation_id}",
                                         headers={"Authorization": f"Bearer {KEY}"})
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.read()

    def steer(self) -> dict:
        return {"steering": [{"name": STEERED, "add": self.vector, "scale": 6.0}]}

    def solo_reference(self) -> tuple[list[int], dict[str, torch.Tensor]]:
        """The reference request's tokens and captured values, alone on the idle server."""
        response = self.complete(list(range(5, 25)), {**self.steer(), "capture": CAPTURED})
        values = load(self.fetch(response.model_extra["vlens"]["activations"]))
        return list(response.choices[0].model_extra["token_ids"]), values

    # ---- what a client does, one request at a time ------------------------------------------

    def reference_again(self, rng: random.Random) -> str:
        """The reference request among the others: its tokens, and its activations where they
        are fetched before newer captures push them out of those held."""
        response = self.complete(list(range(5, 25)), {**self.steer(), "capture": CAPTURED})
        tokens = list(response.choices[0].model_extra["token_ids"])
        if tokens != self.reference[0]:
            return "TOKENS CHANGED"
        try:
            values = load(self.fetch(response.model_extra["vlens"]["activations"]))
        except urllib.error.HTTPError as error:
            return f"same tokens, fetch {error.code}"
        same = all(torch.equal(values[name], self.reference[1][name]) for name in CAPTURED)
        return "same tokens and activations" if same else "ACTIVATIONS CHANGED"

    def plain(self, rng: random.Random) -> str:
        self.complete(prompt_of(rng), None)
        return "ok"

    def steered_by_name(self, rng: random.Random) -> str:
        steer = {"steering": [{"name": STEERED, "add": "up", "scale": 4.0}]}
        self.complete(prompt_of(rng), steer)
        return "ok"

    def capture_and_fetch(self, rng: random.Random) -> str:
        response = self.complete(prompt_of(rng), {**self.steer(), "capture": CAPTURED})
        activation_id = response.model_extra["vlens"]["activations"]
        try:
            self.fetch(activation_id)
        except urllib.error.HTTPError as error:  # dropped by a newer capture before the fetch
            return f"fetch {error.code}"
        try:
            self.fetch(activation_id)
        except urllib.error.HTTPError as error:
            return f"ok, second fetch {error.code}"
        return "SECOND FETCH SERVED"

    def capture_never_fetched(self, rng: random.Random) -> str:
        self.complete(prompt_of(rng), {"capture": CAPTURED})
        return "ok"

    def capture_too_large(self, rng: random.Random) -> str:
        try:
            self.complete(prompt_of(rng, 60), {"capture": TOO_LARGE}, max_tokens=16)
        except openai.BadRequestError as error:
            return "400" if "--capture-bytes" in str(error) else "400, WRONG MESSAGE"
        return "SERVED"

    def guessed_id(self, rng: random.Random) -> str:
        try:
            self.fetch("".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(22)))
        except urllib.error.HTTPError as error:
            return str(error.code)
        return "SERVED"

    def stream_and_leave(self, rng: random.Random) -> str:
        body = {"model": str(tiny_model("llama")), "prompt": prompt_of(rng), "max_tokens": 120,
                "temperature": 0.0, "stream": True, "ignore_eos": True,
                "vlens": {**self.steer(), "capture": CAPTURED}}
        with httpx.stream("POST", f"{self.base}/completions", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {KEY}"}) as response:
            if response.status_code != 200:
                return str(response.status_code)
            events = response.iter_lines()
            for _ in range(rng.randrange(1, 8)):
                next(events)
        return "left"

    def give_up(self, rng: random.Random) -> str:
        impatient = openai.OpenAI(base_url=self.base, api_key=KEY, max_retries=0, timeout=0.3)
        try:
            self.complete(prompt_of(rng), self.steer(), max_tokens=200, client=impatient)
        except openai.APITimeoutError:
            return "gave up"
        return "finished first"

    def client_loop(self, seed: int, deadline: float, plain: bool = False) -> None:
        rng = random.Random(seed)
        actions = [self.plain, self.steered_by_name, self.capture_and_fetch,
                   self.capture_never_fetched, self.capture_too_large, self.guessed_id,
                   self.stream_and_leave, self.give_up, self.reference_again]
        weights = [3, 3, 3, 2, 1, 1, 2, 1, 1]
        if plain:
            actions, weights = [self.plain], [1]
        while time.monotonic() < deadline:
            action = rng.choices(actions, weights)[0]
            try:
                outcome = action(rng)
            except openai.APIStatusError as error:
                outcome = f"ERROR {error.status_code}"
            except (openai.APIConnectionError, httpx.HTTPError, urllib.error.URLError) as error:
                cause = error.__cause__ or error
                outcome = f"ERROR {type(error).__name__} ({type(cause).__name__}: {cause})"[:160]
            self.count(action.__name__, outcome)


def resident_bytes(root: int) -> int:
    """The resident memory of process ``root`` and all its descendants."""
    return sum(resident_by_process(root).values())


def resident_by_process(root: int) -> dict[str, int]:
    """The resident memory of process ``root`` and each of its descendants, by ``pid name``."""
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as stat:
                parent = int(stat.read().rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(int(entry))
        except OSError:
            continue
    found, todo = {}, [root]
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, []))
        try:
            with open(f"/proc/{pid}/comm") as comm, open(f"/proc/{pid}/statm") as statm:
                pages = int(statm.read().split()[1])
                found[f"{pid} {comm.read().strip()}"] = pages * os.sysconf("SC_PAGE_SIZE")
        except OSError:
            continue
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=3.0)
    parser.add_argument("--clients", type=int, default=24)
    parser.add_argument("--out", type=Path, default=Path("bench/out-cpu-soak"))
    parser.add_argument("--plain", action="store_true", help="plain completions only")
    parser.add_argument("--keepalive", type=float,
                        help="seconds the clients keep an idle connection for reuse (default: "
                        "httpx's 5 s, the server's own keep-alive timeout)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    vector = torch.randn(128, generator=torch.Generator().manual_seed(11))
    save_file({"up": vector}, str(args.out / "vectors.safetensors"))
    port = free_port()
    command = [
        sys.executable, "-m", "vlens.cli", "serve", str(tiny_model("llama")), "--port", str(port),
        "--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory-bytes", str(64 << 20),
        "--api-key", KEY, "--vectors", str(args.out / "vectors.safetensors"),
        "--capture-bytes", str(CAPTURE_BYTES),
    ]
    pids: list[int] = []
    with server_process(command, port, args.out / "server.log", api_key=KEY,
                        started=pids.append) as base:
        server_pid = pids[0]
        soak = Soak(base, vector.tolist(), args.keepalive)
        warm = time.monotonic() + 20  # warm-up: every kind of request once, then memory
        soak.client_loop(0, warm, args.plain)
        soak.outcomes.clear()
        processes_start = resident_by_process(server_pid)
        memory_start = sum(processes_start.values())
        start = time.monotonic()
        deadline = start + 60 * args.minutes
        threads = [threading.Thread(target=soak.client_loop, args=(seed, deadline, args.plain))
                   for seed in range(1, args.clients + 1)]
        for thread in threads:
            thread.start()
        memory: list[tuple[int, int, float]] = []  # (seconds, requests so far, MiB)
        while any(thread.is_alive() for thread in threads):
            time.sleep(15)
            served = sum(soak.outcomes.values())
            memory.append((round(time.monotonic() - start), served,
                           round(resident_bytes(server_pid) / 2**20)))
        for thread in threads:
            thread.join()
        time.sleep(5)  # the last aborted requests' clean-up
        idle = status(base, KEY)
        processes_end = resident_by_process(server_pid)
        memory_end = sum(processes_end.values())
        still = soak.reference_again(random.Random(0))
    outcomes = {f"{kind}: {outcome}": n for (kind, outcome), n in sorted(soak.outcomes.items())}
    errors = {key: n for key, n in outcomes.items()
              if any(word in key for word in ("ERROR", "CHANGED", "SERVED", "WRONG"))}
    result = {
        "minutes": args.minutes, "clients": args.clients, "capture_bytes": CAPTURE_BYTES,
        "plain_only": args.plain,
        "keepalive": args.keepalive,
        "requests": sum(soak.outcomes.values()), "outcomes": outcomes, "errors": errors,
        "reference_after": still, "status_when_idle": idle,
        "server_resident_mib": {"after_warm_up": memory_start / 2**20, "end": memory_end / 2**20,
                                "during": memory,
                                "by_process_mib": {
                                    name: [round(processes_start.get(name, 0) / 2**20, 1),
                                           round(size / 2**20, 1)]
                                    for name, size in processes_end.items()}},
    }
    (args.out / "soak.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
