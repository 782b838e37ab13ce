"""Which requests may use vLLM's prefix cache, and with whom they share it.

A prefix-cache hit skips the forward over a prompt's cached tokens: their keys and values come
from another request that computed the same tokens. That is exact for a request that only
generates, and wrong in two ways for vlens: a request that reads names would miss the cached
positions' values, and a request whose forward is changed (a hook function, a steer) computes
keys and values no plain request may reuse, nor it theirs. So, per request (its
:class:`~vlens.runtime.transfer.messages.RequestPlan`):

- nothing asked: it shares the cache as in plain vLLM;
- names read but nothing changed: it computes every position (vLLM's
  ``skip_reading_prefix_cache``) and leaves what it computed for others, which is what a plain
  request computes;
- hook functions (which may change anything): it computes every position, under a salt of its
  own (vLLM's ``cache_salt``), so that no other request reuses its blocks;
- steers (traced into a compiled graph as data, or on an eager engine the hook functions vlens
  makes of them, which compute nothing else): it shares blocks with the requests steered
  identically (a salt from the steers' fingerprint: names, vectors, scales, positions), and
  computes every position as well if it also reads names.
"""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from vlens.runtime.transfer.messages import RequestPlan
from vlens.runtime.vocabulary.steering import AnySteer, SAESteer, Steer, positions_as_data

_own_salts = itertools.count()


@dataclass(frozen=True)
class CacheUse:
    """How one request uses the prefix cache: whether it may read cached blocks, and the salt
    that decides which requests' blocks are its (None: plain vLLM's)."""

    read: bool
    salt: str | None


def cache_use(plan: RequestPlan) -> CacheUse:
    """The prefix-cache use of the request planned by ``plan`` (see the module's docstring)."""
    functions = [function for names in plan.sites.values() for name in names
                 for function in name.hooks]
    hooked = (
        plan.batch_hooked
        or any(not isinstance(getattr(f, "steer", None), Steer) for f in functions)
        or any(any(stage for stage in attention.hooks.values()) for attention in plan.attention)
    )
    if hooked:
        return CacheUse(read=False, salt=f"vlens-own-{next(_own_salts)}-{id(plan)}")
    reads = bool(plan.graph_keep) or bool(plan.attention) or any(
        name.keep for names in plan.sites.values() for name in names
    )
    steers = (*plan.steering, *(function.steer for function in functions))
    salt = f"vlens-steer-{fingerprint(steers)}" if steers else None
    return CacheUse(read=not reads, salt=salt)


def skips_reading(params: Any, use: CacheUse) -> bool:
    """``skip_reading_prefix_cache`` for a request of ``params`` used as ``use`` says: vLLM's
    own reason not to read the cache (prompt logprobs, set on ``params``) stands."""
    return bool(params.skip_reading_prefix_cache) or not use.read


def fingerprint(steers: tuple[AnySteer, ...]) -> str:
    """A digest of everything that decides what ``steers`` compute: equal for equal steering."""
    digest = hashlib.sha256()
    for steer in sorted(steers, key=lambda steer: steer.target):
        digest.update(steer.target.encode())
        if isinstance(steer, SAESteer):
            features = [int(feature) for feature in steer.features]
            digest.update(repr((features, steer.multipliers_and_offsets())).encode())
        else:
            for term in (steer.add, steer.ablate, steer.gain):
                _update(digest, term)
            digest.update(repr(steer.scale).encode())
        digest.update(repr(positions_as_data(steer.positions)).encode())
    return digest.hexdigest()[:32]


def _update(digest: Any, term: Tensor | float | None) -> None:
    if term is None:
        digest.update(b"none")
    elif isinstance(term, Tensor):
        flat = term.detach().to("cpu").contiguous().reshape(-1)
        digest.update(f"{flat.dtype}{tuple(term.shape)}".encode())
        digest.update(flat.view(torch.uint8).numpy())
    else:
        digest.update(repr(float(term)).encode())
