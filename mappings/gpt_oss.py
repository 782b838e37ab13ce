"""GPT-OSS (``GptOssForCausalLM``) as vLLM builds it, in TransformerLens names.

Llama's fused residual (``llama.py``) under vLLM's own module names, attention with biases and
learned sinks, sliding-window and full layers alternating, and a mixture of experts as every
layer's MLP. One decoder layer (``model.layers.{layer}``, called ``layer(hidden, positions,
residual)``)::

    hidden, residual = input_layernorm(hidden, residual)    # residual ← hidden + residual
                                                            # (layer 0: residual ← hidden)
    attn(hidden, positions):
        qkv, _ = qkv_proj(hidden)                           # [q | k | v] with biases
        q, k = rotary_emb(positions, q, k)                  # YaRN, rotate-half (NeoX) pairs
        z = attn(q, k, v)                                   # sinks in the softmax (below);
                                                            # even layers: a sliding window
        hidden, _ = o_proj(z)                               # with a bias
    hidden, residual = post_attention_layernorm(hidden, residual)
    mlp(hidden):
        router_logits = router(hidden)                      # mlp.hook_router_logits (with a bias)
        hidden = experts(hidden, router_logits)             # one fused kernel: top-k, each
                                                            # expert's clamped SwiGLU, the sum
    return hidden, residual                                 # the stream leaving is their sum

``model.embedding`` is the embedding (``hook_embed``); after the last layer ``model.norm(hidden,
residual)`` adds once more and normalises; ``lm_head`` (never tied in vLLM) gives the logits.

Attention sinks: each head has a learned logit ``s_h`` that joins the softmax over the keys and is
dropped after it: ``pattern[h, q, k] = exp(score[h, q, k]) / (Σ_k' exp(score[h, q, k']) +
exp(s_h))``. ``attn.hook_attn_scores`` is ``q·kᵀ/√d_head``, causally (and on sliding layers by
the window) masked, without the sink column; ``attn.hook_pattern`` is HuggingFace's attention
weights and TransformerLens's bridge's ``hook_pattern``: the softmax with the sink column,
which is then dropped, so a row sums to less than one and ``1 − Σ_k pattern`` is the sink's share.
The bridge names no hook for the sinks themselves (it reads them off HuggingFace's module); here
they are the checkpoint's ``model.layers.{layer}.self_attn.sinks``. Scores and patterns are
rebuilt from the rotated q and k with each layer's window and sinks; hooks on them, and on
per-head results, cannot run explicitly (vlens's explicit attention has neither windows per layer
nor sinks): hook ``attn.hook_z``.

Sliding windows: vLLM gives the layers with an even index ``sliding_window`` (the query's own key
included) and the odd ones full attention, whatever ``layer_types`` says; HuggingFace follows
``layer_types``, whose default is that alternation.

Routing: the ``num_experts_per_tok`` largest router logits choose the experts, weighted by the
softmax over those logits (vLLM always renormalizes), :class:`~vlens.mappings._moe.SoftmaxTopK`.
Each expert computes ``gate, up = x·W + b`` (HuggingFace stores them interleaved: gate on even
columns), ``gate.clamp(max=7)``, ``up.clamp(-7, 7)``, ``(up + 1) · gate · σ(1.702·gate)``, then
its down projection with a bias. No single expert's activations exist to hook (one fused kernel);
a MoE layer has no single ``W_in``/``W_gate``/``W_out`` either.

What vLLM computes otherwise than HuggingFace, and is refused where a config asks for it
(:func:`check_served`): vLLM's norms use eps 1e-5 whatever ``rms_norm_eps`` says; its experts' clamp
and gain are 7.0 and 1.702 whatever ``swiglu_limit`` and ``swiglu_alpha`` say; its rotary
embedding is always YaRN; its attention always has biases; its ``lm_head`` is never tied to the
embedding; its windows alternate as above. Otherwise the two agree to rounding: on the tiny
checkpoint in fp32 (sliding window 8, prompts up to 19 tokens plus 6 decoded) every name is within
7.4e-6 relative per token of HuggingFace (the router logits, after two layers of fused-kernel
experts), and every name TransformerLens's bridge has but the routing within 2.7e-6 of it
(``tests/engine/test_moe.py``; its routing hooks hold another layout,
:data:`~vlens.mappings._moe.BRIDGE_ROUTING_LAYOUT`). Every name reads the same traced into the
compiled graph as eager.

Checkpoints whose experts are MXFP4-quantized (``quant_method: mxfp4``, as ``openai/gpt-oss-*``
are published) are refused on vLLM's CPU backend, which has no MXFP4 expert kernel for them
(vLLM 0.32: "No MXFP4 MoE backend supports the deployment configuration"); the refusal names the
fix, an unquantized copy of the checkpoint (:func:`mxfp4_refusal`; checked on such a copy). On a GPU vLLM runs them with its MXFP4
kernels (bfloat16 activations); the names are read at the same modules, but only unquantized
checkpoints are proven against HuggingFace here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torch import Tensor
from transformers import GptOssConfig, PretrainedConfig

from vlens.mappings._moe import (
    BRIDGE_ROUTING_LAYOUT,
    ROUTER_LOGITS,
    ROUTING_NAMES,
    RoutedExpertRefusal,
    SoftmaxTopK,
)
from vlens.mappings._tiny import rotary_dims
from vlens.mappings.gemma2 import LayerAttentionScores
from vlens.names.derived import Batch, BuiltOnRead
from vlens.names.lazy_patterns import LazyAttention
from vlens.names.mapping import (
    ArchitectureMapping,
    Argument,
    DerivedSpec,
    NoExplicitAttention,
    Shards,
    Spec,
    attention_dimensions,
    columns,
    entering,
    expert_indices,
    expert_weights,
    head_results,
    leaving,
    logits,
    per_head,
    repeated_per_head,
    rms_normalized,
    rms_scale,
)
from vlens.names.weights import WeightNames

LAYER = "model.layers.{layer}"
ATTN = f"{LAYER}.attn"
MLP = f"{LAYER}.mlp"
BLOCK = "blocks.{layer}"
#: The checkpoint's (HuggingFace's) names of a layer's attention weights.
CHECKPOINT_ATTN = f"{LAYER}.self_attn"

#: What vLLM's GPT-OSS computes with whatever the config says (see the module's docstring).
VLLM_EPS = 1e-5
VLLM_SWIGLU = {"swiglu_alpha": 1.702, "swiglu_limit": 7.0}

NOT_EXPLICIT = NoExplicitAttention(
    "GPT-OSS's attention has learned sinks and a sliding window on every other layer, which "
    "vlens's explicit attention does not compute; hook attn.hook_rot_q, attn.hook_rot_k, "
    "attn.hook_v or attn.hook_z instead"
)


@dataclass(frozen=True)
class SinkSoftmax(BuiltOnRead):
    """The attention pattern from the scores with each head's sink logit in the softmax's
    denominator (checkpoint tensor ``sinks_name``, ``[head]``), the sink column then dropped."""

    sinks_name: str

    def for_layer(self, layer: int) -> SinkSoftmax:
        return SinkSoftmax(self.sinks_name.format(layer=layer))

    def __call__(self, sources: list[LazyAttention], batch: Batch) -> LazyAttention:
        (scores,) = sources
        sinks: Tensor = batch.weights[self.sinks_name]
        return dataclasses.replace(scores.softmaxed(), sinks=sinks.float())


def vllm_windows(config: PretrainedConfig) -> tuple[int | None, ...]:
    """The sliding window vLLM gives each layer: ``sliding_window`` on even layers."""
    return tuple(
        config.sliding_window if layer % 2 == 0 else None
        for layer in range(config.num_hidden_layers)
    )


def hf_windows(config: PretrainedConfig) -> tuple[int | None, ...]:
    """The sliding window HuggingFace gives each layer, from ``layer_types``."""
    return tuple(
        config.sliding_window if kind == "sliding_attention" else None
        for kind in config.layer_types
    )


def mxfp4_refusal(config: PretrainedConfig) -> str | None:
    """Why an MXFP4-quantized checkpoint cannot be served here (vLLM's CPU backend has no MXFP4
    expert kernel), with the fix; None for any other checkpoint, or on a GPU."""
    quantization = getattr(config, "quantization_config", None) or {}
    method = (
        quantization.get("quant_method")
        if isinstance(quantization, dict)
        else getattr(quantization, "quant_method", None)
    )
    if str(getattr(method, "value", method)) not in ("mxfp4", "gpt_oss_mxfp4"):
        return None
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return None
    return (
        "this GPT-OSS checkpoint's experts are MXFP4-quantized (quantization_config.quant_method="
        "'mxfp4'), and vLLM's CPU backend has no MXFP4 expert kernel for them. Serve it on a "
        "GPU, or an unquantized copy: load it with AutoModelForCausalLM.from_pretrained(path, "
        "quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.bfloat16), "
        "write its state_dict() with safetensors' save_file (save_pretrained leaves the "
        "dequantized experts out) and config.json without quantization_config, and the tokenizer"
    )


def check_served(config: PretrainedConfig) -> None:
    """Refuse a config for which vLLM's GPT-OSS computes otherwise than HuggingFace's, or that
    vLLM cannot run here (see the module's docstring)."""
    refusal = mxfp4_refusal(config)
    if refusal is not None:
        raise NotImplementedError(refusal)
    reasons = []
    if config.rms_norm_eps != VLLM_EPS:
        reasons.append(f"rms_norm_eps={config.rms_norm_eps} (vLLM's norms use {VLLM_EPS})")
    for attribute, value in VLLM_SWIGLU.items():
        if getattr(config, attribute) != value:
            reasons.append(
                f"{attribute}={getattr(config, attribute)} (vLLM's experts use {value})"
            )
    rope_type = (config.rope_parameters or {}).get("rope_type")
    if rope_type != "yarn":
        reasons.append(f"rope_type={rope_type!r} (vLLM's GPT-OSS always rotates with YaRN)")
    if not getattr(config, "attention_bias", True):
        reasons.append("attention_bias=False (vLLM's GPT-OSS attention always has biases)")
    if config.tie_word_embeddings:
        reasons.append("tie_word_embeddings=True (vLLM's GPT-OSS never ties lm_head)")
    if hf_windows(config) != vllm_windows(config):
        reasons.append(
            f"layer_types={config.layer_types} (vLLM slides the window on the even layers only)"
        )
    if reasons:
        raise NotImplementedError(
            "vLLM's GptOssForCausalLM computes this checkpoint otherwise than its config says: "
            + "; ".join(reasons)
            + ". vlens serves GPT-OSS checkpoints with the published settings only; change the "
            "config to them (or serve it with model_impl='transformers'), see mappings/gpt_oss.py"
        )


def router(config: PretrainedConfig) -> SoftmaxTopK:
    """The routing vLLM builds for ``MLPBlock``: softmax over the top-k logits."""
    return SoftmaxTopK(top_k=config.num_experts_per_tok, renormalize=True)


def hook_specs(config: PretrainedConfig) -> dict[str, Spec]:
    check_served(config)
    eps = VLLM_EPS
    heads, kv_heads, d_head = attention_dimensions(config)
    q_end, k_end = heads * d_head, (heads + kv_heads) * d_head
    v_end = k_end + kv_heads * d_head

    resid_pre = entering(LAYER, Argument(0, "hidden_states"), plus=Argument(2, "residual"))
    resid_mid = entering(
        f"{LAYER}.post_attention_layernorm", Argument(0, "x"), plus=Argument(1, "residual")
    )
    resid_final = entering("model.norm", Argument(0, "x"), plus=Argument(1, "residual"))
    # Under tensor parallelism each rank holds its heads of these (and its sinks); the experts'
    # output is reduced over the ranks inside the MoE block, whole at hook_mlp_out.
    q_heads, kv_heads_split = Shards(-1, (q_end,)), Shards(-1, (k_end - q_end,))
    qkv = leaving(f"{ATTN}.qkv_proj", element=0, shards=Shards(-1, (q_end, k_end - q_end, v_end - k_end)))
    scores = DerivedSpec(
        (f"{BLOCK}.attn.hook_rot_q", f"{BLOCK}.attn.hook_rot_k"),
        LayerAttentionScores(d_head**-0.5, None, vllm_windows(config)),
        "head query_pos key_pos",
        hookable=NOT_EXPLICIT,
    )
    pattern = DerivedSpec(
        (f"{BLOCK}.attn.hook_attn_scores",),
        SinkSoftmax(f"{CHECKPOINT_ATTN}.sinks"),
        "head query_pos key_pos",
        hookable=NOT_EXPLICIT,
    )
    route = router(config)
    return {
        "hook_embed": leaving("model.embedding"),
        f"{BLOCK}.hook_resid_pre": resid_pre,
        f"{BLOCK}.hook_attn_in": repeated_per_head(resid_pre, heads),
        f"{BLOCK}.hook_q_input": repeated_per_head(resid_pre, heads),
        f"{BLOCK}.hook_k_input": repeated_per_head(resid_pre, kv_heads, "kv_head"),
        f"{BLOCK}.hook_v_input": repeated_per_head(resid_pre, kv_heads, "kv_head"),
        f"{BLOCK}.ln1.hook_scale": rms_scale(resid_pre, eps),
        f"{BLOCK}.ln1.hook_normalized": rms_normalized(resid_pre, eps),
        f"{BLOCK}.attn.hook_q": per_head(columns(qkv, 0, q_end, "pos"), d_head),
        f"{BLOCK}.attn.hook_k": per_head(columns(qkv, q_end, k_end, "pos"), d_head, "kv_head"),
        f"{BLOCK}.attn.hook_v": per_head(columns(qkv, k_end, v_end, "pos"), d_head, "kv_head"),
        f"{BLOCK}.attn.hook_rot_q": per_head(
            entering(f"{ATTN}.attn", Argument(0, "query", q_heads)), d_head
        ),
        f"{BLOCK}.attn.hook_rot_k": per_head(
            entering(f"{ATTN}.attn", Argument(1, "key", kv_heads_split)), d_head, "kv_head"
        ),
        f"{BLOCK}.attn.hook_attn_scores": scores,
        f"{BLOCK}.attn.hook_pattern": pattern,
        f"{BLOCK}.attn.hook_z": per_head(
            entering(f"{ATTN}.o_proj", Argument(0, "input_", q_heads)), d_head
        ),
        f"{BLOCK}.attn.hook_result": head_results(
            f"{BLOCK}.attn.hook_z", f"{CHECKPOINT_ATTN}.o_proj.weight", NOT_EXPLICIT
        ),
        f"{BLOCK}.hook_attn_out": leaving(ATTN),
        f"{BLOCK}.hook_resid_mid": resid_mid,
        f"{BLOCK}.hook_mlp_in": resid_mid,
        f"{BLOCK}.ln2.hook_scale": rms_scale(resid_mid, eps),
        f"{BLOCK}.ln2.hook_normalized": rms_normalized(resid_mid, eps),
        ROUTER_LOGITS: leaving(f"{MLP}.router", shape="pos n_routed_experts"),
        ROUTING_NAMES[1]: expert_weights(ROUTER_LOGITS, route),
        ROUTING_NAMES[2]: expert_indices(ROUTER_LOGITS, route),
        f"{BLOCK}.hook_mlp_out": leaving(MLP),
        f"{BLOCK}.hook_resid_post": leaving(LAYER, element=0, plus=1),
        "ln_final.hook_scale": rms_scale(resid_final, eps),
        "ln_final.hook_normalized": rms_normalized(resid_final, eps),
        "unembed.hook_out": logits(leaving("model.norm", element=0)),
    }


def tiny_config() -> PretrainedConfig:
    """GPT-OSS: 4 experts of 64, top-2; head_dim 32; a sliding window of 8 keys (shorter than
    the parity prompts) on layers 0 and 2, full attention on layer 1; YaRN rotary with a
    factor over a short original context; untied unembedding."""
    settings = {**rotary_dims(), "intermediate_size": 64}
    del settings["rope_parameters"]
    return GptOssConfig(
        **settings,
        head_dim=32,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=8,
        rms_norm_eps=VLLM_EPS,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 128,
        },
    )


WEIGHTS = WeightNames(
    normalization="RMS",
    eps=VLLM_EPS,
    W_E="model.embed_tokens.weight",
    W_Q=f"{CHECKPOINT_ATTN}.q_proj.weight",
    W_K=f"{CHECKPOINT_ATTN}.k_proj.weight",
    W_V=f"{CHECKPOINT_ATTN}.v_proj.weight",
    W_O=f"{CHECKPOINT_ATTN}.o_proj.weight",
    b_Q=f"{CHECKPOINT_ATTN}.q_proj.bias",
    b_K=f"{CHECKPOINT_ATTN}.k_proj.bias",
    b_V=f"{CHECKPOINT_ATTN}.v_proj.bias",
    b_O=f"{CHECKPOINT_ATTN}.o_proj.bias",
    ln1_w=f"{LAYER}.input_layernorm.weight",
    ln2_w=f"{LAYER}.post_attention_layernorm.weight",
    ln_final_w="model.norm.weight",
    W_U=("lm_head.weight",),
)

MAPPING = ArchitectureMapping(
    architectures=("GptOssForCausalLM",),
    hook_specs=hook_specs,
    weights=WEIGHTS,
    unavailable=RoutedExpertRefusal((*ROUTING_NAMES, f"{BLOCK}.hook_mlp_out")),
    compiled_graph=True,
    tensor_parallel=True,
    tiny_configs={"gpt_oss": tiny_config},
    hf_recorder="hf_gpt_oss",
    no_bridge_reference=BRIDGE_ROUTING_LAYOUT,
)
