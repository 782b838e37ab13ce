"""The reference for edits: adding a vector at a vlens hook name, done instead in HuggingFace
transformers with a PyTorch hook on the module that computes that name's value.

Only the tiny test architectures are covered, and in them only the names the editing tests write:
the residual stream of every architecture, and more names of Llama, Qwen3 and GPT-2.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn
from transformers.modeling_outputs import CausalLMOutputWithPast


@dataclass(frozen=True)
class Site:
    """Where a name's value is in HuggingFace: the first input or the output of ``module``, at
    ``[..., offset : offset + width]`` of its last axis (GPT-2 computes q, k and v in one
    matmul)."""

    module: nn.Module
    side: Literal["input", "output"]
    offset: int = 0


def llama_sites(model: nn.Module) -> dict[str, Site]:
    """Llama and Qwen3: each attention or MLP output feeds only its residual sum."""
    sites = {}
    for layer, block in enumerate(model.model.layers):
        sites |= {
            f"blocks.{layer}.hook_resid_pre": Site(block, "input"),
            f"blocks.{layer}.hook_resid_mid": Site(block.self_attn, "output"),
            f"blocks.{layer}.hook_resid_post": Site(block, "output"),
            f"blocks.{layer}.attn.hook_q": Site(block.self_attn.q_proj, "output"),
            f"blocks.{layer}.attn.hook_z": Site(block.self_attn.o_proj, "input"),
            f"blocks.{layer}.mlp.hook_post": Site(block.mlp.down_proj, "input"),
        }
    return sites


def gpt2_sites(model: nn.Module) -> dict[str, Site]:
    """GPT-2: the attention output feeds only the residual sum, so resid_mid and attn_out are
    edited at the same place."""
    d_model = model.config.hidden_size
    sites = {
        "hook_embed": Site(model.transformer.wte, "output"),
        "hook_pos_embed": Site(model.transformer.wpe, "output"),
    }
    for layer, block in enumerate(model.transformer.h):
        sites |= {
            f"blocks.{layer}.hook_resid_pre": Site(block, "input"),
            f"blocks.{layer}.hook_resid_mid": Site(block.attn, "output"),
            f"blocks.{layer}.hook_attn_out": Site(block.attn, "output"),
            f"blocks.{layer}.hook_resid_post": Site(block, "output"),
            f"blocks.{layer}.attn.hook_q": Site(block.attn.c_attn, "output"),
            f"blocks.{layer}.attn.hook_k": Site(block.attn.c_attn, "output", d_model),
            f"blocks.{layer}.attn.hook_v": Site(block.attn.c_attn, "output", 2 * d_model),
            f"blocks.{layer}.attn.hook_z": Site(block.attn.c_proj, "input"),
            f"blocks.{layer}.mlp.hook_pre": Site(block.mlp.c_fc, "output"),
            f"blocks.{layer}.mlp.hook_post": Site(block.mlp.c_proj, "input"),
            f"blocks.{layer}.hook_mlp_out": Site(block.mlp, "output"),
        }
    return sites


def residual_sites(model: nn.Module) -> dict[str, Site]:
    """Any decoder: the residual stream entering and leaving each of its layers (the first
    ``ModuleList`` with one entry per layer), whatever the layer computes inside."""
    n_layers = model.config.get_text_config().num_hidden_layers
    layers = next(module for module in model.modules()
                  if isinstance(module, nn.ModuleList) and len(module) == n_layers)
    sites = {}
    for layer, block in enumerate(layers):
        sites |= {f"blocks.{layer}.hook_resid_pre": Site(block, "input"),
                  f"blocks.{layer}.hook_resid_post": Site(block, "output")}
    return sites


SITES: dict[str, Callable[[nn.Module], dict[str, Site]]] = {
    "LlamaForCausalLM": llama_sites,
    "Qwen3ForCausalLM": llama_sites,
    "GPT2LMHeadModel": gpt2_sites,
}


def plus(value: Tensor, vector: Tensor, offset: int) -> Tensor:
    """A copy of ``value`` with ``vector`` added at ``[..., offset : offset + width]``."""
    edited = value.clone()
    edited[..., offset : offset + vector.shape[-1]] += vector
    return edited


@torch.no_grad()
def forward_with_added(
    model: nn.Module, tokens: Tensor, name: str, vector: Tensor
) -> CausalLMOutputWithPast:
    """HuggingFace's forward of ``tokens`` (one prompt) with ``vector`` (``[pos, width]``) added
    where vlens reads ``name``; hidden states included. The hook is gone afterwards."""
    site = SITES.get(model.config.architectures[0], residual_sites)(model)[name]

    def add_to_input(_m: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args:
            return (plus(args[0], vector, site.offset), *args[1:]), kwargs
        hidden = kwargs["hidden_states"]
        return args, {**kwargs, "hidden_states": plus(hidden, vector, site.offset)}

    def add_to_output(_m: nn.Module, _args: tuple, output: Tensor | tuple) -> Tensor | tuple:
        if isinstance(output, tuple):
            return (plus(output[0], vector, site.offset), *output[1:])
        return plus(output, vector, site.offset)

    # First among the module's hooks, so that HuggingFace's own hidden-state recorders see the
    # edited value, however many forwards ran before.
    if site.side == "input":
        handle = site.module.register_forward_pre_hook(add_to_input, with_kwargs=True, prepend=True)
    else:
        handle = site.module.register_forward_hook(add_to_output, prepend=True)
    try:
        return model(tokens, output_hidden_states=True)
    finally:
        handle.remove()
