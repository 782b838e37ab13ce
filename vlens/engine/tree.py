"""vLLM's module tree of a checkpoint's config, built on the meta device: no weights, no engine.

``print(weightless_model(folder))`` shows the tree a real engine would build — module paths for
raw locations, fused projections, where norms sit — in about a second after vLLM is imported,
for any config, including models far too large for this machine (a folder holding only a
``config.json`` is enough).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vlens.engine.process_state import classes_left_as_they_were, single_device_groups


def weightless_model(path: str | Path, **engine_args: Any) -> nn.Module:
    """The vLLM model for ``path``'s config, with every parameter on the meta device.

    ``engine_args`` go to vLLM's ``EngineArgs`` (e.g. ``max_model_len``); the model is built as
    for one device (no tensor parallelism).
    """
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import get_model_architecture

    args = {"skip_tokenizer_init": True, "load_format": "dummy", "enforce_eager": True}
    config = EngineArgs(model=str(path), **{**args, **engine_args}).create_engine_config()
    single_device_groups()
    with set_current_vllm_config(config), classes_left_as_they_were():
        model_class, _ = get_model_architecture(config.model_config)
        with torch.device("meta"):
            return model_class(vllm_config=config, prefix="")
