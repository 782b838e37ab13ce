"""A server (``vlens serve`` or ``vllm serve``) as a child process, for tests and benchmarks."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextmanager
def server_process(
    command: Sequence[str],
    port: int,
    log: Path,
    api_key: str | None = None,
    start_timeout: float = 300.0,
    env: dict[str, str] | None = None,
    started: Callable[[int], None] | None = None,
) -> Iterator[str]:
    """Run ``command`` (a server listening on 127.0.0.1:``port``) until the block ends; yields
    its base URL (``http://127.0.0.1:PORT/v1``) once ``/v1/models`` answers. Its output goes to
    ``log``, whose tail a failed start raises with; ``started`` is told the server's process id."""
    with open(log, "wb") as output:
        child = subprocess.Popen(
            list(command), stdout=output, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
            start_new_session=True,  # the engine's processes go with it
        )
        if started is not None:
            started(child.pid)
        try:
            base = f"http://127.0.0.1:{port}/v1"
            _wait_until_serving(child, f"{base}/models", api_key, start_timeout, log)
            yield base
        finally:
            _stop(child)


def _wait_until_serving(
    child: subprocess.Popen, url: str, api_key: str | None, timeout: float, log: Path
) -> None:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if child.poll() is not None:
            raise RuntimeError(f"the server exited ({child.returncode}):\n{_tail(log)}")
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=5):
                return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(1.0)
    raise RuntimeError(f"the server did not answer within {timeout:.0f} s:\n{_tail(log)}")


def _stop(child: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (vLLM shuts its engine down), then SIGKILL."""
    if child.poll() is not None:
        return
    os.killpg(child.pid, signal.SIGTERM)
    try:
        child.wait(timeout=60)
    except subprocess.TimeoutExpired:
        pass
    try:  # whatever of the group is left (an engine process that did not follow)
        os.killpg(child.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    child.wait()


def status(base: str, api_key: str | None = None) -> dict:
    """``GET /v1/vlens/status`` of the server at ``base``."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    request = urllib.request.Request(f"{base}/vlens/status", headers=headers)
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def settled(base: str, api_key: str | None = None, timeout: float = 30.0) -> dict:
    """The server's status once it answers no request, holds no plan and its workers follow no
    request (or as it is after ``timeout`` seconds)."""
    deadline = time.monotonic() + timeout
    while True:
        now = status(base, api_key)
        idle = all(not any(counts.values()) for counts in now["workers"])
        if (idle and not now["tickets"] and not now["in_flight"]) or time.monotonic() > deadline:
            return now
        time.sleep(0.1)


def _tail(log: Path, lines: int = 80) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
