"""Reference values for canonical names, from HuggingFace transformers and TransformerLens.

HuggingFace: the same checkpoint in fp32 with eager attention; each name is read off the HF
module that computes it (forward hooks), so the reference never goes through vLLM or vlens.
TransformerLens: ``TransformerBridge.boot_transformers(path)`` with
``enable_compatibility_mode(no_processing=True)``, whose cache uses the same names.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import import_module
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

Values = dict[str, Tensor]  # canonical name -> [pos, ...] for one prompt


def load_hf(path: str | Path) -> nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


class Recorder:
    """Forward hooks on HuggingFace modules that keep what they see, by a key of our choosing."""

    def __init__(self) -> None:
        self.seen: dict[str, Any] = {}
        self.handles: list[Any] = []

    def inputs(self, module: nn.Module, key: str, argument: str) -> None:
        def hook(_m: nn.Module, args: tuple, kwargs: dict) -> None:
            self.seen[key] = kwargs[argument] if argument in kwargs else args[0]

        self.handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))

    def output(self, module: nn.Module, key: str) -> None:
        def hook(_m: nn.Module, _args: tuple, output: Any) -> None:
            self.seen[key] = output[0] if isinstance(output, tuple) else output

        self.handles.append(module.register_forward_hook(hook))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def after_blocks(out: Values, final_norm: tuple[Tensor, Tensor], logits: Tensor) -> Values:
    """``out`` completed with the final norm's scale and normalized value and the logits, every
    value without its batch axis (the reference runs one prompt at a time)."""
    out["ln_final.hook_scale"], out["ln_final.hook_normalized"] = final_norm
    out["unembed.hook_out"] = logits
    return {name: value[0] for name, value in out.items()}


def rms_parts(x: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    scale = (x.pow(2).mean(-1, keepdim=True) + eps).sqrt()
    return scale, x / scale


def recorder_for(architecture: str) -> Callable[..., Callable[[Tensor, tuple[Tensor, ...]], Values]]:
    """The ``record(model, recorder)`` of the module of this package that the architecture's
    mapping names (``ArchitectureMapping.hf_recorder``): it installs the hooks and returns the
    function turning one forward's recordings into canonical names."""
    from vlens.mappings import served

    mapping = served().get(architecture)
    if mapping is None or mapping.hf_recorder is None:
        raise NotImplementedError(
            f"no HuggingFace reference for {architecture}: its mapping file names no hf_recorder"
        )
    return import_module(f"vlens.parity.{mapping.hf_recorder}").record


@torch.no_grad()
def hf_reference(path: str | Path, prompts: list[list[int]]) -> list[Values]:
    """Every name HuggingFace can give, for each prompt run alone."""
    model = load_hf(path)
    architecture = model.config.architectures[0]
    recorder = Recorder()
    to_values = recorder_for(architecture)(model, recorder)
    try:
        results = []
        for prompt in prompts:
            output = model(torch.tensor([prompt]), output_attentions=True)
            results.append(to_values(output.logits, output.attentions))
        return results
    finally:
        recorder.remove()


@torch.no_grad()
def transformer_lens_reference(
    path: str | Path, prompts: list[list[int]], names: list[str]
) -> list[Values] | None:
    """The same names from TransformerLens's own cache, for each prompt run alone; None when
    TransformerLens cannot set the model up with the hooks compared here (DeepSeek's MLA: the
    bridge has no split-qkv input hooks for it), or when TransformerLens is not installed (the
    GPU machine: HuggingFace is the only reference there)."""
    try:
        from transformer_lens.model_bridge import TransformerBridge
    except ImportError:
        return None

    try:
        bridge = TransformerBridge.boot_transformers(str(path), device="cpu", dtype=torch.float32)
        bridge.enable_compatibility_mode(no_processing=True)
        # The names TransformerLens computes only when asked (hook_attn_in excludes the split
        # inputs).
        bridge.set_use_attn_result(True)
        bridge.set_use_split_qkv_input(True)
        bridge.set_use_hook_mlp_in(True)
    except (AttributeError, NotImplementedError):
        return None
    results = []
    for prompt in prompts:
        logits, cache = bridge.run_with_cache(torch.tensor([prompt]))
        values = {name: cache[name][0] for name in names if name in cache.cache_dict}
        if "unembed.hook_out" in names:
            values["unembed.hook_out"] = logits[0]
        results.append(values)
    return results
