"""`vlens serve` under careless and hostile clients and under signals: every malformed or extreme
body gets the 4xx it should (never a 5xx, never garbage tokens), a client that leaves is quiet, a
short mixed load leaves nothing behind, SIGKILL of the server's process leaves no process and no
bound port behind, and SIGTERM answers every request in flight (finished, or a 503 within
``--shutdown-timeout``) before everything exits. The long soak is ``bench/serve_soak.py``."""

from __future__ import annotations

import base64
import json
import os
import random
import signal
import socket
import struct
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import save_file

from vlens.serve.process import free_port, server_process, settled, status
from vlens.testing.tiny import tiny_model

KEY = "hostile"
MODEL = str(tiny_model("llama"))
STEERED = "blocks.1.hook_resid_post"
HEADERS = {"Authorization": f"Bearer {KEY}"}


def command(port: int, folder: Path, engine_args: dict, *more: str) -> list[str]:
    save_file({"up": torch.randn(128, generator=torch.Generator().manual_seed(11))},
              str(folder / "vectors.safetensors"))
    return [
        sys.executable, "-m", "vlens.cli", "serve", MODEL, "--port", str(port), "--dtype",
        "float32", "--max-model-len", "256", "--kv-cache-memory-bytes",
        str(engine_args["kv_cache_memory_bytes"]), "--api-key", KEY, "--vectors",
        str(folder / "vectors.safetensors"), "--capture-bytes", str(1 << 20), *more,
    ]


@pytest.fixture(scope="module")
def served(tmp_path_factory, engine_args):
    """The base URL and log of a server for the module's tests."""
    folder = tmp_path_factory.mktemp("hostile")
    port = free_port()
    log = folder / "server.log"
    with server_process(command(port, folder, engine_args), port, log, api_key=KEY) as base:
        yield base, log


def post(
    base: str, body: dict | bytes, timeout: float = 60.0, client: httpx.Client | None = None
) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return (client or httpx).post(f"{base}/completions", content=content, timeout=timeout,
                                  headers={**HEADERS, "Content-Type": "application/json"})


def body(vlens: object = None, **options: object) -> dict:
    request = {"model": MODEL, "prompt": [5, 6, 7, 8, 9], "max_tokens": 4, "temperature": 0.0,
               "ignore_eos": True, "return_token_ids": True, **options}
    return request if vlens is None else {**request, "vlens": vlens}


def steer(**entry: object) -> dict:
    return {"steering": [{"name": STEERED, **entry}]}


def assert_forgotten(base: str) -> None:
    now = settled(base, KEY)
    assert all(not any(counts.values()) for counts in now["workers"]), now
    assert now["tickets"] == 0 and now["unclaimed_captures"] == 0, now


ONES = [1.0] * 128
HUGE = float(2**40)
INF_BYTES = base64.b64encode(struct.pack("<128f", *([float("inf")] + [0.0] * 127))).decode()

#: (what a client sends, the status it must get, a phrase of the answer's message)
FUZZ: list[tuple[str, dict | bytes, int, str]] = [
    ("add beyond float32", body(steer(add=[1e300] * 128)), 400, "beyond float32"),
    ("add times scale beyond float32", body(steer(add=[3e38] * 128, scale=10)), 400, "scale"),
    ("scale beyond float32", body(steer(add=ONES, scale=1e300)), 400, "add × scale"),
    ("gain beyond float32", body(steer(gain=[1e300] * 128)), 400, "beyond float32"),
    ("gain at float32's end", body(steer(gain=3e38)), 400, "gain"),
    ("gain past float32's end", body(steer(gain=1e39)), 400, "gain"),
    ("values the next norm overflows on", body(steer(add=[HUGE] * 128)), 400, "overflowing"),
    ("a registered vector scaled too far", body(steer(add="up", scale=1e12)), 400, "scale"),
    ("overflow beside a capture",
     body({**steer(add=[1e300] * 128), "capture": [STEERED]}), 400, "beyond float32"),
    ("an SAE steer's overflow on an eager server",
     body({"steering": [{"sae": "none", "features": [1], "scale": 1e300}]}), 400, ""),
    ("infinity as JSON", b'{"model": "%s", "prompt": [5, 6], "vlens": {"steering": [{"name": "%s",'
     b' "add": [1e400]}]}}' % (MODEL.encode(), STEERED.encode()), 400, "non-finite"),
    ("NaN as JSON", b'{"model": "%s", "prompt": [5, 6], "vlens": {"steering": [{"name": "%s",'
     b' "add": [NaN]}]}}' % (MODEL.encode(), STEERED.encode()), 400, ""),
    ("infinity in base64", body(steer(add={"base64": INF_BYTES})), 400, "non-finite"),
    ("base64 that is not", body(steer(add={"base64": "%%%"})), 400, "base64"),
    ("vlens a string", body("steer please"), 400, "object"),
    ("steering a string", body({"steering": "up"}), 400, "list"),
    ("an unknown name", body({"steering": [{"name": "blocks.99.hook_resid_post", "add": "up"}]}),
     400, "blocks.99"),
    ("a vector of the wrong size", body(steer(add=[1.0, 2.0, 3.0])), 400, "elements"),
    ("a vector of a million numbers", body(steer(add=[0.5] * 1_000_000)), 400, "elements"),
    ("booleans as a vector", body(steer(add=[True, False])), 400, "array of numbers"),
    ("a scale as a string", body(steer(add=ONES, scale="2")), 400, "scale"),
    ("negative positions", body(steer(add=ONES, positions=[-1, None])), 400, "positions"),
    ("positions of booleans", body(steer(add=ONES, positions=[True, 3])), 400, "positions"),
    ("nested arrays", body({"steering": [[[[[[{"name": STEERED}]]]]]]}), 400, "object"),
    ("an unknown capture", body({"capture": ["blocks.0.hook_nothing"]}), 400, "hook_nothing"),
    ("a capture as a string", body({"capture": STEERED}), 400, "list of hook names"),
    ("an unknown field", body({"steer": []}), 400, "unknown field"),
    ("reserved vllm_xargs", body(None, vllm_xargs={"vlens_fields": "x"}), 400, "reserved"),
    ("a body that is not JSON", b"{", 400, ""),
    ("an empty body", b"", 400, ""),
    ("negative max_tokens", body(None, max_tokens=-1), 400, ""),
]


@pytest.mark.parametrize("what, request_body, expected, phrase", FUZZ, ids=[f[0] for f in FUZZ])
def test_each_malformed_or_extreme_body_gets_its_4xx(served, what, request_body, expected, phrase):
    base, _ = served
    response = post(base, request_body)
    assert response.status_code == expected, (what, response.status_code, response.text[:500])
    assert phrase in response.text, response.text[:500]


def test_refused_bodies_leave_nothing_and_change_no_one(served):
    """After every body of the fuzz list (twice), the server holds nothing, and a steered,
    capturing request answers as it did before."""
    base, _ = served
    reference = body({**steer(add="up", scale=6.0), "capture": [STEERED]}, max_tokens=8)
    before = post(base, reference).json()
    for _, request_body, _, _ in FUZZ * 2:
        post(base, request_body)
    assert_forgotten(base)
    after = post(base, reference).json()
    assert after["choices"][0]["token_ids"] == before["choices"][0]["token_ids"]


def test_a_client_that_leaves_a_capture_is_quiet(served):
    """A client that closes its socket right after posting a capturing request: no 500 and no
    traceback in the server's log, and nothing held after."""
    base, log = served
    port = int(base.rsplit(":", 1)[1].split("/")[0])
    request = json.dumps(body({"capture": [STEERED]}, max_tokens=200)).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(request)}\r\n\r\n").encode()
    before = log.read_text(errors="replace")
    for _ in range(4):
        with socket.create_connection(("127.0.0.1", port)) as connection:
            connection.sendall(head + request)
            time.sleep(0.2)
    assert_forgotten(base)
    added = log.read_text(errors="replace")[len(before):]
    assert "Traceback" not in added and " 500 " not in added, added[-3000:]


def test_a_short_mixed_load_is_answered_as_each_request_deserves(served):
    """Twelve clients for twenty seconds: plain, steered, capturing (fetched and not), refused,
    abandoned and streamed-then-left requests. Every answer is of its expected class, none hangs,
    and the server holds nothing after."""
    base, _ = served
    refused = [entry[1] for entry in FUZZ if entry[2] == 400]
    outcomes: list[str] = []
    lock = threading.Lock()

    def one(rng: random.Random) -> str:
        kind = rng.choice(["plain", "steered", "capture", "refused", "leave", "stream"])
        prompt = [rng.randrange(3, 500) for _ in range(rng.randrange(3, 30))]
        if kind == "refused":
            return f"refused {post(base, rng.choice(refused)).status_code}"
        if kind == "leave":
            try:
                post(base, body(steer(add="up"), prompt=prompt, max_tokens=200), timeout=0.2)
            except httpx.TimeoutException:
                return "left"
            return "left 200"
        if kind == "stream":
            request = body({**steer(add="up"), "capture": [STEERED]}, prompt=prompt,
                           max_tokens=100, stream=True)
            with httpx.stream("POST", f"{base}/completions", json=request, headers=HEADERS,
                              timeout=60) as response:
                lines = response.iter_lines()
                for _ in range(3):
                    next(lines)
                return f"stream {response.status_code}"
        fields = {"plain": None, "steered": steer(add="up", scale=4.0),
                  "capture": {"capture": [STEERED, "blocks.0.hook_resid_post"]}}[kind]
        response = post(base, body(fields, prompt=prompt, max_tokens=8))
        if kind == "capture" and response.status_code == 200 and rng.random() < 0.5:
            activation = response.json()["vlens"]["activations"]
            fetch = urllib.request.Request(f"{base}/activations/{activation}", headers=HEADERS)
            with urllib.request.urlopen(fetch, timeout=60) as fetched:
                fetched.read()
        return f"{kind} {response.status_code}"

    def client(seed: int, deadline: float) -> None:
        rng = random.Random(seed)
        while time.monotonic() < deadline:
            try:
                outcome = one(rng)
            except (httpx.HTTPError, urllib.error.URLError) as error:
                outcome = f"ERROR {type(error).__name__}"
            with lock:
                outcomes.append(outcome)

    deadline = time.monotonic() + 20
    with ThreadPoolExecutor(12) as pool:
        list(pool.map(lambda seed: client(seed, deadline), range(12)))
    expected = {"plain 200", "steered 200", "capture 200", "refused 400", "left", "left 200",
                "stream 200"}
    unexpected = [outcome for outcome in outcomes if outcome not in expected]
    assert len(outcomes) > 50 and not unexpected, (len(outcomes), unexpected[:20])
    assert_forgotten(base)
    assert status(base, KEY)["captures"]["bytes"] <= 1 << 20


def family(root: int) -> set[int]:
    """Process ``root`` and its descendants."""
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        found.add(pid)
        todo.extend(children.get(pid, []))
    return found


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_sigkill_of_the_server_leaves_no_process_and_frees_the_port(tmp_path, engine_args):
    """A supervisor kills exactly the server's pid: its engine's processes follow within
    seconds, and a new server starts on the same port at once."""
    port = free_port()
    pids: list[int] = []
    server = command(port, tmp_path, engine_args)
    with server_process(server, port, tmp_path / "first.log", api_key=KEY, started=pids.append):
        processes = family(pids[0])
        assert len(processes) > 1  # the engine runs in a process of its own
        os.kill(pids[0], signal.SIGKILL)
        deadline = time.monotonic() + 20
        while any(map(alive, processes)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not [pid for pid in processes if alive(pid)]
    with server_process(server, port, tmp_path / "second.log", api_key=KEY) as base:
        assert post(base, body()).status_code == 200


@pytest.mark.parametrize("timeout", [None, 30.0], ids=["abort", "drain"])
def test_sigterm_answers_every_request_in_flight_then_everything_exits(
    tmp_path, engine_args, timeout
):
    """SIGTERM with eight requests in flight (plain, steered, capturing, streamed): with vLLM's
    default (no --shutdown-timeout) each is answered at once with a 503 or its completion;
    with --shutdown-timeout each finishes within it. Requests that arrive meanwhile get a 503
    (or find the port closed), and the server's processes are gone within seconds."""
    port = free_port()
    pids: list[int] = []
    # One sequence at a time: the requests queue in vLLM, each in flight for seconds
    more = ("--max-num-seqs", "1") + (() if timeout is None else ("--shutdown-timeout", str(int(timeout))))
    server = command(port, tmp_path, engine_args, *more)
    with server_process(server, port, tmp_path / "server.log", api_key=KEY,
                        started=pids.append) as base:
        processes = family(pids[0])
        requests = [body(None, max_tokens=240), body(steer(add="up"), max_tokens=240),
                    body({"capture": [STEERED]}, max_tokens=240)] * 2
        streamed = body(steer(add="up"), max_tokens=240, stream=True)

        pooled = httpx.Client(limits=httpx.Limits(max_connections=16))
        for _ in range(8):  # connections open before the requests are sent
            post(base, body(None, max_tokens=1), client=pooled)

        def stream() -> str:
            try:
                with pooled.stream("POST", f"{base}/completions", json=streamed,
                                  headers=HEADERS, timeout=60) as response:
                    events = [line for line in response.iter_lines() if line]
            except httpx.HTTPError as error:
                return f"ERROR {type(error).__name__}"
            if events[-1:] != ["data: [DONE]"]:
                return "STREAM NOT ENDED"
            return "stream 503" if '"code": 503' in events[-2] else "stream 200"

        with ThreadPoolExecutor(8) as pool:
            answers = [pool.submit(post, base, request, 60.0, pooled) for request in requests]
            streams = [pool.submit(stream) for _ in range(2)]
            deadline = time.monotonic() + 60
            while status(base, KEY)["in_flight"] < len(requests) + 2:  # all of them running
                assert time.monotonic() < deadline, status(base, KEY)
                time.sleep(0.05)
            signalled = time.monotonic()
            os.kill(pids[0], signal.SIGTERM)
            time.sleep(0.2)
            try:
                late = post(base, body()).status_code
            except httpx.HTTPError:
                late = "closed"
            statuses = [future.result().status_code for future in answers]
            ends = [future.result() for future in streams]
            answered = time.monotonic() - signalled
        assert late in (503, "closed")
        assert set(statuses) <= {200, 503} and set(ends) <= {"stream 200", "stream 503"}, (
            statuses, ends)
        bound = 5.0 if timeout is None else timeout + 5.0
        assert answered < bound
        if timeout is None:  # some were still running
            assert 503 in statuses or "stream 503" in ends, (statuses, ends)
            log = (tmp_path / "server.log").read_text(errors="replace")
            assert "unhandled exception" not in log  # every aborted request ended in the server
        else:  # every request fits in the drain
            assert set(statuses) == {200} and set(ends) == {"stream 200"}
        deadline = time.monotonic() + 20
        while any(map(alive, processes)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [pid for pid in processes if alive(pid)]
        assert time.monotonic() - signalled < bound + 15
