"""Building a HuggingFace model (or TransformerLens's bridge) in a process that also runs vLLM.

vLLM's Transformers backend decorates HuggingFace's own decoder class in place for its compiler
(GPT-NeoX's ``GPTNeoXModel``, OLMo-2's ``Olmo2Model``...): once an engine of such an architecture
has been built, that class's constructor reads vLLM's *current config*, and HuggingFace's
``from_pretrained`` / ``from_config`` of the same model type, or TransformerLens's
``boot_transformers``, fails with "Current vLLM config is not set". :func:`beside_vllm` gives the
constructor a config with compilation off that names the checkpoint's config, which leaves the
model HuggingFace's own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any


@contextlib.contextmanager
def beside_vllm(checkpoint: str | Path | Any) -> Iterator[None]:
    """While HuggingFace builds the model of ``checkpoint`` (a folder, or its transformers
    config) here; nothing happens where vLLM is not installed."""
    try:
        from vllm.config import CompilationConfig, CompilationMode, VllmConfig
        from vllm.config import set_current_vllm_config
    except ImportError:
        yield
        return
    from transformers import AutoConfig

    hf_config = (
        AutoConfig.from_pretrained(checkpoint) if isinstance(checkpoint, (str, Path)) else checkpoint
    )
    config = VllmConfig(compilation_config=CompilationConfig(mode=CompilationMode.NONE))
    # What the decorated constructor reads of the model (its rotary scaling).
    object.__setattr__(config, "model_config", SimpleNamespace(hf_config=hf_config))
    with set_current_vllm_config(config):
        yield
