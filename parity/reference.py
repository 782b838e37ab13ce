"""Reference values for canonical names, from HuggingFace transformers and TransformerLens.

HuggingFace: the same checkpoint in fp32 with eager attention; each name is read off the HF
module that computes it (forward hooks), so the reference never goes through vLLM or vlens.
TransformerLens: ``TransformerBridge.boot_transformers(path)`` with
``enable_compatibility_mode(no_processing=True)``, whose cache uses the same names.
"""

from __future__ import annotations

from collections.abc import Callable
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


def rms_parts(x: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    scale = (x.pow(2).mean(-1, keepdim=True) + eps).sqrt()
    return scale, x / scale


def record_llama_like(model: nn.Module, recorder: Recorder) -> Callable[[Tensor], Values]:
    """Hooks for Llama and Qwen3 (``model.model.layers[i]`` with RMSNorm); returns the function
    that turns one forward's recordings (and its logits) into canonical names."""
    eps = model.config.rms_norm_eps
    inner = model.model
    recorder.output(inner.embed_tokens, "embed")
    for i, layer in enumerate(inner.layers):
        recorder.inputs(layer, f"pre{i}", "hidden_states")
        recorder.output(layer.self_attn, f"attn{i}")
        recorder.inputs(layer.post_attention_layernorm, f"mid{i}", "hidden_states")
        recorder.output(layer.mlp, f"mlp{i}")
        recorder.output(layer, f"post{i}")
    recorder.inputs(inner.norm, "final", "hidden_states")

    def values(logits: Tensor) -> Values:
        seen = recorder.seen
        out = {"hook_embed": seen["embed"]}
        for i in range(len(inner.layers)):
            out[f"blocks.{i}.hook_resid_pre"] = seen[f"pre{i}"]
            out[f"blocks.{i}.hook_attn_out"] = seen[f"attn{i}"]
            out[f"blocks.{i}.hook_resid_mid"] = seen[f"mid{i}"]
            out[f"blocks.{i}.hook_mlp_out"] = seen[f"mlp{i}"]
            out[f"blocks.{i}.hook_resid_post"] = seen[f"post{i}"]
        scale, normalized = rms_parts(seen["final"], eps)
        out["ln_final.hook_scale"] = scale
        out["ln_final.hook_normalized"] = normalized
        out["unembed.hook_out"] = logits
        return {name: value[0] for name, value in out.items()}

    return values


RECORDERS = {"LlamaForCausalLM": record_llama_like, "Qwen3ForCausalLM": record_llama_like}


@torch.no_grad()
def hf_reference(path: str | Path, prompts: list[list[int]]) -> list[Values]:
    """Every name HuggingFace can give, for each prompt run alone."""
    model = load_hf(path)
    architecture = model.config.architectures[0]
    recorder = Recorder()
    to_values = RECORDERS[architecture](model, recorder)
    try:
        results = []
        for prompt in prompts:
            logits = model(torch.tensor([prompt])).logits
            results.append(to_values(logits))
        return results
    finally:
        recorder.remove()


@torch.no_grad()
def transformer_lens_reference(
    path: str | Path, prompts: list[list[int]], names: list[str]
) -> list[Values]:
    """The same names from TransformerLens's own cache, for each prompt run alone."""
    from transformer_lens.model_bridge import TransformerBridge

    bridge = TransformerBridge.boot_transformers(str(path), dtype=torch.float32)
    bridge.enable_compatibility_mode(no_processing=True)
    results = []
    for prompt in prompts:
        logits, cache = bridge.run_with_cache(torch.tensor([prompt]))
        values = {name: cache[name][0] for name in names if name in cache.cache_dict}
        if "unembed.hook_out" in names:
            values["unembed.hook_out"] = logits[0]
        results.append(values)
    return results
