"""vlens: TransformerLens's hook names and habits on models served by vLLM.

The public names load on first use, so that ``import vlens.<module>`` (which vLLM's worker
processes do for the runtime) does not import the facade, TransformerLens or vLLM.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vlens.engine.tree import weightless_model as weightless_model
    from vlens.hooked.model import HookedVLLM as HookedVLLM
    from vlens.runtime.transfer.messages import HookError as HookError
    from vlens.runtime.vocabulary.steering import SAESteer as SAESteer
    from vlens.runtime.vocabulary.steering import Steer as Steer

_PUBLIC = {
    "HookedVLLM": "vlens.hooked.model",
    "HookError": "vlens.runtime.transfer.messages",
    "SAESteer": "vlens.runtime.vocabulary.steering",
    "Steer": "vlens.runtime.vocabulary.steering",
    "weightless_model": "vlens.engine.tree",
}

__all__ = list(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'vlens' has no attribute {name!r}")
    return getattr(importlib.import_module(_PUBLIC[name]), name)
