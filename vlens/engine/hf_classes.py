"""HuggingFace's classes left as they were by an engine built in this process.

vLLM's Transformers backend (GPT-NeoX, OLMo-2 and the other architectures it runs through
HuggingFace's own module tree) marks the decoder class it builds for its compiler by rewriting the
class in place: a new base, a new ``__init__`` that reads vLLM's current config and a new
``__call__``. A HuggingFace model of that class built before the engine then fails on its next
forward (its instance lacks what the new ``__call__`` reads), and one built after fails in the new
``__init__`` (there is no current vLLM config outside vLLM's loading). vlens runs these
architectures in eager mode, where the rewritten ``__call__`` only calls ``forward``; so once the
engine is built, each class the backend rewrote gets its own attributes back, and the engine's
model instance runs HuggingFace's ``forward`` as before.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

#: What vLLM's compile decorator changes on a class.
_CHANGED = ("__init__", "__call__", "_ignore_compile_vllm")
_ABSENT = object()


@contextmanager
def classes_left_as_they_were() -> Iterator[None]:
    """While an engine is built: every class outside vLLM that vLLM's compile decorator rewrites
    is restored when the block ends (vLLM's own model classes, decorated where they are defined,
    are left decorated)."""
    try:
        from vllm.compilation import decorators
    except ImportError:  # a vLLM without the decorator rewrites nothing
        yield
        return
    decorate = decorators._support_torch_compile
    originals: dict[type, tuple[tuple[type, ...], dict[str, Any]]] = {}

    def recording(cls: type, *args: Any, **kwargs: Any) -> type:
        if not cls.__module__.startswith("vllm.") and cls not in originals:
            originals[cls] = (cls.__bases__, {key: cls.__dict__.get(key, _ABSENT) for key in _CHANGED})
        return decorate(cls, *args, **kwargs)

    decorators._support_torch_compile = recording
    try:
        yield
    finally:
        decorators._support_torch_compile = decorate
        for cls, (bases, attributes) in originals.items():
            cls.__bases__ = bases
            for key, value in attributes.items():
                if value is _ABSENT:
                    if key in cls.__dict__:
                        delattr(cls, key)
                else:
                    setattr(cls, key, value)
