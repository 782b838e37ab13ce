"""A server's captures, held until their client fetches them, within a byte bound, the least
recently held dropped first."""

from __future__ import annotations

import secrets
import threading
from collections import OrderedDict

from safetensors.torch import save
from torch import Tensor


class HeldCaptures:
    """Each completion choice's captured values, as a safetensors file ready to send, under an
    unguessable id; taken (and deleted) when fetched, or dropped, oldest first, when a new entry
    needs the room. An entry larger than the whole bound is refused."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError(f"captures need a positive byte bound (--capture-bytes), got {max_bytes}")
        self.max_bytes = max_bytes
        self.entries: OrderedDict[str, bytes] = OrderedDict()
        self.size = 0
        self.lock = threading.Lock()

    def put(self, values: dict[str, Tensor]) -> str:
        """Keep ``values`` (name → ``[pos, ...]``); returns the id to fetch them by."""
        payload = save({name: value.contiguous() for name, value in values.items()})
        if len(payload) > self.max_bytes:
            raise ValueError(
                f"the captured activations take {len(payload):,} bytes, more than the server's "
                f"whole bound for held captures ({self.max_bytes:,} bytes, --capture-bytes); "
                "capture fewer names or positions"
            )
        key = secrets.token_urlsafe(16)
        with self.lock:
            while self.size + len(payload) > self.max_bytes:
                _, dropped = self.entries.popitem(last=False)
                self.size -= len(dropped)
            self.entries[key] = payload
            self.size += len(payload)
        return key

    def status(self) -> dict[str, int]:
        with self.lock:
            return {"entries": len(self.entries), "bytes": self.size, "max_bytes": self.max_bytes}

    def take(self, key: str) -> bytes | None:
        """The entry's safetensors bytes, removed from those held; None if unknown or dropped."""
        with self.lock:
            payload = self.entries.pop(key, None)
            if payload is not None:
                self.size -= len(payload)
            return payload
