"""BLOOM (``BloomForCausalLM``) as vLLM builds it, in TransformerLens names.

A sequential pre-norm block with LayerNorms and biases everywhere, no positional embedding or
rotary: each head adds an ALiBi bias, ``slope·position`` of the key, to its attention scores. The
embedding is normed before the first block. No fused residual, every add plain Python. The model
and one block (``transformer``; ``transformer.h.{layer}``, called ``block(positions, hidden)``,
returning the stream)::

    hidden = word_embeddings(ids)
    hidden = word_embeddings_layernorm(hidden)    # hook_embed, as TransformerLens gives it
    block(positions, hidden):                     # hidden = resid_pre
        normed = input_layernorm(hidden)          # LayerNorm, weight and bias
        self_attention(positions, normed):
            qkv, _ = query_key_value(normed)      # [q | k | v], H·d_head each part, with biases
            q, k, v = qkv.chunk(3, dim=-1)        # (vLLM regroups HuggingFace's per-head [q k v])
            z = attn(q, k, v)                     # scale 1/sqrt(d_head), ALiBi slopes per head
            out, _ = dense(z)                     # with b_O
        mid = out + hidden                        # resid_mid
        normed = post_attention_layernorm(mid)
        mlp(normed):
            x, _ = dense_h_to_4h(normed)          # hook_pre
            x = gelu_impl(x)                      # hook_post is dense_4h_to_h's input
            out, _ = dense_4h_to_h(x)
        return out + mid                          # resid_post
    hidden = ln_f(hidden)                         # logits: lm_head (tied: the embedding)

``hook_embed`` is the normed embedding, as in TransformerLens (HookedTransformer's embedding with
``post_embedding_ln``, and the bridge, whose ``hook_embed`` is ``embed_ln.hook_out``);
``embed_ln.hook_scale`` and ``embed_ln.hook_normalized`` are that norm's, named as the bridge
names the module (``embed_ln``).

Attention scores are rebuilt from ``hook_q`` and ``hook_k`` (there is no rotation, so no
``hook_rot_q``/``hook_rot_k``) with the ALiBi bias as HuggingFace and TransformerLens's bridge add
it: ``q·kᵀ/sqrt(d_head) + slope·key_position``, the future at -inf. vLLM's kernel adds
``slope·(key − query)`` instead, which differs by a constant per query row, so the pattern is the
same. Where a hook function is on scores, pattern or per-head results,
the worker computes that layer's attention itself, with the same bias
(:class:`~vlens.names.mapping.ExplicitAttention` with ``alibi``).

vLLM's MLP applies the exact (erf) GELU; BLOOM was trained with, and HuggingFace computes, the tanh
approximation: on the tiny checkpoint ``mlp.hook_post`` differed from HuggingFace's by 2.0e-4
relative per token and the logits by 3.0e-4. vlens gives vLLM's BLOOM MLPs the tanh approximation
when the model loads (:func:`vlens.runtime.patches.bloom_tanh_gelu`), so every name below is
HuggingFace's. Checkpoints with
``apply_residual_connection_post_layernorm`` (the residual taken after each norm) are refused: the
stream this mapping reads would not be the one added.

On CUDA, vLLM (0.26 and, by its source, 0.32) fails BLOOM in half precision on a Hopper GPU: its
FlashAttention backend plans every step for FlashAttention 3, but ALiBi runs on FlashAttention 2,
which refuses that plan ("FA2 does not support scheduler_metadata, q_descale, k_descale,
v_descale"). vlens asks vLLM for FlashAttention 2 throughout (:data:`CUDA_ENGINE_ARGS`, which a
user's ``attention_config`` replaces).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import BloomConfig, PretrainedConfig

from vlens.mappings._tiny import shared_settings
from vlens.names import derived
from vlens.names.mapping import (
    ArchitectureMapping,
    Argument,
    DerivedSpec,
    ExplicitAttention,
    ExplicitStage,
    Shards,
    Spec,
    attention_pattern,
    attention_scores,
    columns,
    entering,
    layer_norm_normalized,
    layer_norm_scale,
    leaving,
    logits,
    per_head,
    repeated_per_head,
)
from vlens.names.weights import WeightNames

LAYER = "transformer.h.{layer}"
ATTN = f"{LAYER}.self_attention"
MLP = f"{LAYER}.mlp"
BLOCK = "blocks.{layer}"
EMBED_NORM = "transformer.word_embeddings_layernorm"


def alibi_slopes(heads: int) -> tuple[float, ...]:
    """Each head's ALiBi slope (BLOOM's): ``2^(-8h/n)`` for heads ``h = 1..n``, ``n`` the largest
    power of two up to ``heads``; the heads past ``n`` take every other slope of ``2n`` heads
    (computed in float32, as HuggingFace and vLLM compute them)."""
    n = 2 ** math.floor(math.log2(heads))
    base = torch.tensor(2 ** (-8 / n), dtype=torch.float32)
    slopes = base ** torch.arange(1, n + 1, dtype=torch.int32)
    if n != heads:
        extra = torch.tensor(2 ** (-8 / (2 * n)), dtype=torch.float32)
        odd = torch.arange(1, 2 * min(n, heads - n), 2, dtype=torch.int32)
        slopes = torch.cat([slopes, extra**odd])
    return tuple(slopes.tolist())


@dataclass(frozen=True)
class HeadResults:
    """:class:`~vlens.names.derived.HeadResults` for a checkpoint that may leave the
    ``transformer.`` prefix out of its names (BLOOM's published checkpoints do): the first of
    ``weight_names`` present is used."""

    weight_names: tuple[str, ...]

    def for_layer(self, layer: int) -> HeadResults:
        return HeadResults(tuple(name.format(layer=layer) for name in self.weight_names))

    def __call__(self, sources: list[Tensor], batch: derived.Batch) -> Tensor:
        (z,) = sources
        name = next((n for n in self.weight_names if n in batch.weights), self.weight_names[0])
        return derived.batched_head_results(z, batch.weights[name].T)


def check_served(config: PretrainedConfig) -> None:
    if getattr(config, "apply_residual_connection_post_layernorm", False):
        raise NotImplementedError(
            "this BLOOM checkpoint sets apply_residual_connection_post_layernorm=True (each "
            "residual taken after its norm), which mappings/bloom.py does not name; only "
            "checkpoints without it are served"
        )


def hook_specs(config: PretrainedConfig) -> dict[str, Spec]:
    check_served(config)
    eps = config.layer_norm_epsilon
    heads = config.n_head
    d_model = config.hidden_size
    d_head = d_model // heads
    scale = d_head**-0.5
    slopes = alibi_slopes(heads)

    embed_raw = entering(EMBED_NORM, Argument(0, "input"))
    resid_pre = entering(LAYER, Argument(1, "hidden_states"))
    resid_mid = entering(f"{LAYER}.post_attention_layernorm", Argument(0, "input"))
    resid_final = entering("transformer.ln_f", Argument(0, "input"))
    # Under tensor parallelism each rank holds its heads of these (and their ALiBi slopes), and
    # its part of d_mlp.
    heads_split, mlp_split = Shards(-1, (d_model,)), Shards(-1, (4 * d_model,))
    qkv = leaving(f"{ATTN}.query_key_value", element=0,
                  shards=Shards(-1, (d_model, d_model, d_model)))
    explicit = ExplicitAttention(
        kernel=f"{ATTN}.attn",
        projection=f"{ATTN}.dense",
        heads=heads,
        kv_heads=heads,
        d_head=d_head,
        scale=scale,
        alibi=slopes,
    )
    w_o = "h.{layer}.self_attention.dense.weight"
    results = DerivedSpec(
        (f"{BLOCK}.attn.hook_z",),
        HeadResults((f"transformer.{w_o}", w_o)),
        "pos head d_model",
        hookable=ExplicitStage(explicit, "result"),
    )
    return {
        "embed_ln.hook_scale": layer_norm_scale(embed_raw, eps),
        "embed_ln.hook_normalized": layer_norm_normalized(embed_raw, eps),
        "hook_embed": leaving(EMBED_NORM),
        f"{BLOCK}.hook_resid_pre": resid_pre,
        f"{BLOCK}.hook_attn_in": repeated_per_head(resid_pre, heads),
        f"{BLOCK}.hook_q_input": repeated_per_head(resid_pre, heads),
        f"{BLOCK}.hook_k_input": repeated_per_head(resid_pre, heads),
        f"{BLOCK}.hook_v_input": repeated_per_head(resid_pre, heads),
        f"{BLOCK}.ln1.hook_scale": layer_norm_scale(resid_pre, eps),
        f"{BLOCK}.ln1.hook_normalized": layer_norm_normalized(resid_pre, eps),
        f"{BLOCK}.attn.hook_q": per_head(columns(qkv, 0, d_model, "pos"), d_head),
        f"{BLOCK}.attn.hook_k": per_head(columns(qkv, d_model, 2 * d_model, "pos"), d_head),
        f"{BLOCK}.attn.hook_v": per_head(columns(qkv, 2 * d_model, 3 * d_model, "pos"), d_head),
        f"{BLOCK}.attn.hook_attn_scores": attention_scores(
            f"{BLOCK}.attn.hook_q", f"{BLOCK}.attn.hook_k", scale, explicit, alibi=slopes
        ),
        f"{BLOCK}.attn.hook_pattern": attention_pattern(f"{BLOCK}.attn.hook_attn_scores", explicit),
        f"{BLOCK}.attn.hook_z": per_head(
            entering(f"{ATTN}.dense", Argument(0, "input_", heads_split)), d_head
        ),
        f"{BLOCK}.attn.hook_result": results,
        f"{BLOCK}.hook_attn_out": leaving(ATTN),
        f"{BLOCK}.hook_resid_mid": resid_mid,
        f"{BLOCK}.hook_mlp_in": resid_mid,
        f"{BLOCK}.ln2.hook_scale": layer_norm_scale(resid_mid, eps),
        f"{BLOCK}.ln2.hook_normalized": layer_norm_normalized(resid_mid, eps),
        f"{BLOCK}.mlp.hook_pre": leaving(f"{MLP}.dense_h_to_4h", element=0, shape="pos d_mlp",
                                         shards=mlp_split),
        f"{BLOCK}.mlp.hook_post": entering(
            f"{MLP}.dense_4h_to_h", Argument(0, "input_", mlp_split), shape="pos d_mlp"
        ),
        f"{BLOCK}.hook_mlp_out": leaving(MLP),
        f"{BLOCK}.hook_resid_post": leaving(LAYER),
        "ln_final.hook_scale": layer_norm_scale(resid_final, eps),
        "ln_final.hook_normalized": layer_norm_normalized(resid_final, eps),
        "unembed.hook_out": logits(leaving("transformer.ln_f")),
    }


def tiny_config() -> PretrainedConfig:
    """BLOOM: 6 heads of 32 (not a power of two, so that the extra ALiBi slopes are used), the
    MLP 4·d_model wide, tied unembedding."""
    return BloomConfig(
        **shared_settings(),
        hidden_size=192,
        n_layer=3,
        n_head=6,
        layer_norm_epsilon=1e-5,
        apply_residual_connection_post_layernorm=False,
    )


#: BLOOM's published checkpoints name their tensors without ``transformer.``.
WEIGHTS = WeightNames(
    normalization="LN",
    eps="layer_norm_epsilon",
    W_E="transformer.word_embeddings.weight",
    W_QKV=f"{ATTN}.query_key_value.weight",
    b_QKV=f"{ATTN}.query_key_value.bias",
    qkv_per_head=True,
    W_O=f"{ATTN}.dense.weight",
    b_O=f"{ATTN}.dense.bias",
    W_in=f"{MLP}.dense_h_to_4h.weight",
    b_in=f"{MLP}.dense_h_to_4h.bias",
    W_out=f"{MLP}.dense_4h_to_h.weight",
    b_out=f"{MLP}.dense_4h_to_h.bias",
    ln1_w=f"{LAYER}.input_layernorm.weight",
    ln1_b=f"{LAYER}.input_layernorm.bias",
    ln2_w=f"{LAYER}.post_attention_layernorm.weight",
    ln2_b=f"{LAYER}.post_attention_layernorm.bias",
    ln_final_w="transformer.ln_f.weight",
    ln_final_b="transformer.ln_f.bias",
    W_U=("lm_head.weight", "transformer.word_embeddings.weight"),
    optional_prefix="transformer.",
)

#: FlashAttention 2 for every layer on CUDA, where ALiBi needs it (the docstring says why).
CUDA_ENGINE_ARGS = {"attention_config": {"flash_attn_version": 2}}

MAPPING = ArchitectureMapping(
    architectures=("BloomForCausalLM",),
    hook_specs=hook_specs,
    weights=WEIGHTS,
    compiled_graph=True,
    tensor_parallel=True,
    cuda_engine_args=CUDA_ENGINE_ARGS,
    tiny_configs={"bloom": tiny_config},
    hf_recorder="hf_bloom",
    no_bridge_reference=(
        "TransformerLens's bridge gives BLOOM's hook_q_input, hook_k_input and hook_v_input as "
        "ln1's output (its BloomBlockBridge does not capture the block input that other blocks "
        "fork per head), where TransformerLens's meaning, and vlens's, is the block input before "
        "ln1; every other name agreed with the bridge within 2.7e-6 relative per token, prefill "
        "and decode, ALiBi scores included"
    ),
)
