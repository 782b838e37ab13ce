"""Apertus (``ApertusForCausalLM``) as vLLM builds it, in TransformerLens names.

Llama's decoder (``llama.py``: the same fused residual, ``qkv_proj``, ``rotary_emb``, ``attn``,
``o_proj``) with its norms named ``attention_layernorm`` and ``feedforward_layernorm``, q and k
normed per head before the rotary embedding (Qwen3's ``q_norm``/``k_norm``), and an ungated MLP
with the xIELU activation. One layer (``model.layers.{layer}``, called
``layer(positions, hidden, residual)``)::

    hidden, residual = attention_layernorm(hidden, residual)     # residual ← resid_pre
    self_attn(positions, hidden):
        q, k, v = qkv_proj(hidden)[0].split(...)
        q = q_norm(q.view(pos, H, d_head))                       # attn.hook_q_normed (*)
        k = k_norm(k.view(pos, Hkv, d_head))                     # attn.hook_k_normed (*)
        q, k = rotary_emb(positions, q, k)                       # attn.hook_rot_q, hook_rot_k
        hidden = o_proj(attn(q, k, v))
    hidden, residual = feedforward_layernorm(hidden, residual)   # residual ← resid_mid
    mlp(hidden):
        x, _ = up_proj(hidden)                                   # mlp.hook_pre
        x = act_fn(x)                                            # xIELU: mlp.hook_post
        hidden, _ = down_proj(x)
    return hidden, residual                                      # the stream leaving is their sum

xIELU (``act_fn``, learned ``alpha_p``, ``alpha_n`` per layer, ``beta`` = 0.5)::

    x > 0:  softplus(alpha_p)·x² + beta·x
    x ≤ 0:  (expm1(min(x, eps)) − x)·(beta + softplus(alpha_n)) + beta·x

(*) vLLM 0.26 calls the norms on ``[pos·H, d_head]`` rows instead (the same per-row RMSNorm); the
names read both layouts as ``[pos, H, d_head]``.

An ungated MLP has no ``hook_pre_linear``. vLLM 0.32 builds xIELU's parameters in bf16
whatever the engine's dtype: an fp32 engine would load ``alpha_p``/``alpha_n`` rounded to bf16 and
compute ``softplus(alpha)`` in bf16, where HuggingFace's model in fp32 keeps both in fp32. vlens
has vLLM build them in the model's dtype (:mod:`vlens.runtime.patches`), so an fp32 engine
computes xIELU as HuggingFace does; a bf16 engine is unchanged. Without that, on the tiny
checkpoint in fp32, ``blocks.0.mlp.hook_post`` differs from HuggingFace's by 8.2e-4 relative per
token and the logits by 7.6e-4.
"""

import dataclasses

from transformers import ApertusConfig, PretrainedConfig

from vlens.mappings import llama
from vlens.mappings._tiny import rotary_dims
from vlens.mappings.llama import BLOCK, LAYER, MLP, fused_residual
from vlens.names.mapping import (
    Argument,
    Shards,
    Spec,
    attention_dimensions,
    entering,
    heads_in_rows,
    inserted_before,
    leaving,
)


def hook_specs(config: PretrainedConfig) -> dict[str, Spec]:
    """Llama's names over Apertus's norms, with its q/k norms and its ungated MLP."""
    stream = dataclasses.replace(
        fused_residual(config.rms_norm_eps),
        mid=entering(
            f"{LAYER}.feedforward_layernorm", Argument(0, "x"), plus=Argument(1, "residual")
        ),
    )
    specs = llama.decoder_specs(config, stream)
    d_mlp = config.intermediate_size
    del specs[f"{BLOCK}.mlp.hook_pre_linear"]
    specs[f"{BLOCK}.mlp.hook_pre"] = leaving(
        f"{MLP}.up_proj", element=0, shape="pos d_mlp", shards=Shards(-1, (d_mlp,))
    )
    return inserted_before(specs, f"{BLOCK}.attn.hook_rot_q", per_head_norms(config))


def per_head_norms(config: PretrainedConfig) -> dict[str, Spec]:
    """Qwen3's ``hook_q_normed``/``hook_k_normed``, read from either layout of the norms' rows:
    vLLM 0.26 calls them on ``[pos·heads, d_head]``, 0.27 and later on ``[pos, heads, d_head]``."""
    heads, kv_heads, _ = attention_dimensions(config)
    norms = llama.per_head_norms(config)
    q_normed, k_normed = f"{BLOCK}.attn.hook_q_normed", f"{BLOCK}.attn.hook_k_normed"
    return {
        q_normed: heads_in_rows(norms[q_normed], heads),
        k_normed: heads_in_rows(norms[k_normed], kv_heads),
    }


def tiny_config() -> PretrainedConfig:
    """Apertus: QK-norm, xIELU, untied unembedding."""
    return ApertusConfig(
        **rotary_dims(), head_dim=32, rms_norm_eps=1e-5, tie_word_embeddings=False
    )


#: Llama's checkpoint names with Apertus's norms and its ungated MLP (``up_proj`` is ``W_in``).
WEIGHTS = dataclasses.replace(
    llama.WEIGHTS,
    W_gate=None,
    ln1_w=f"{LAYER}.attention_layernorm.weight",
    ln2_w=f"{LAYER}.feedforward_layernorm.weight",
)

MAPPING = llama.MAPPING.member(
    "ApertusForCausalLM",
    hook_specs=hook_specs,
    weights=WEIGHTS,
    tiny_configs={"apertus": tiny_config},
    hf_recorder="hf_decoder",
)
