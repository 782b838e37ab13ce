"""Falcon (``FalconForCausalLM``, Falcon-7B's layout) as vLLM builds it, in TransformerLens names.

Attention and MLP in parallel on one LayerNorm's output, multi-query attention (one key/value
head), rotary positions, no biases. No fused residual. The model and one layer
(``transformer``; ``transformer.h.{layer}``, called ``layer(positions, hidden)``, returning the
stream)::

    hidden = word_embeddings(ids)                         # hook_embed
    layer(positions, hidden):                             # hidden = resid_pre
        residual = hidden
        normed = input_layernorm(hidden)                  # LayerNorm
        self_attention(positions, normed):
            qkv, _ = query_key_value(normed)              # [q | k | v]: H heads, 1, 1
            q, k = rotary_emb(positions, q, k)            # whole heads, rotate-half
            z = attn(q, k, v)                             # scale 1/sqrt(d_head)
            out, _ = dense(z)
        mlp(normed):                                      # the same normed input
            x, _ = dense_h_to_4h(normed)                  # hook_pre
            x = act(x)                                    # GELU (erf)
            out, _ = dense_4h_to_h(x)
        return mlp_out + attn_out + residual              # resid_post
    hidden = ln_f(hidden)                                 # logits: lm_head (tied: the embedding)

As in TransformerLens's bridge for a block with one norm before both halves, there is no
``hook_resid_mid``, ``hook_mlp_in`` or ``ln2`` (see :func:`~vlens.mappings.gptj.parallel_block_error`).
``hook_k``/``hook_v`` (and ``hook_k_input``/``hook_v_input``) have the one key/value head.

Under tensor parallelism each rank holds its query heads and part of the MLP's hidden units, and
the one key/value head whole (vLLM replicates it); the parallel block's ``attn_out + mlp_out`` is
all-reduced once, so ``hook_attn_out`` and ``hook_mlp_out`` are partial sums on each rank until
then (:class:`PartialSums`).

Other Falcon layouts are refused with the reason: vLLM's Falcon differs from HuggingFace's where
a config sets ``ffn_hidden_size`` other than ``4·hidden_size`` or an ``activation`` other than
``gelu`` (vLLM's MLP is always ``4·hidden_size`` wide with GELU, HuggingFace's follows the
config); biases (``bias=True``, Falcon-RW) are added by vLLM after the projections return; and
ALiBi, the new decoder architecture (Falcon-40B/180B: grouped keys, two norms) and the
sequential block are layouts this mapping does not name.
"""

from transformers import FalconConfig, PretrainedConfig

from vlens.mappings._tiny import MAX_POSITIONS, shared_settings
from vlens.mappings.gptj import parallel_block_error
from vlens.names.mapping import (
    ArchitectureMapping,
    Argument,
    ExplicitAttention,
    PartialSums,
    Shards,
    Spec,
    attention_dimensions,
    attention_pattern,
    attention_scores,
    columns,
    entering,
    head_results,
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


def check_served(config: PretrainedConfig) -> None:
    """Refuse the Falcon layouts this mapping does not name (see the module's docstring)."""
    served = {
        "parallel_attn": True,
        "multi_query": True,
        "new_decoder_architecture": False,
        "alibi": False,
        "bias": False,
        "activation": "gelu",
        "ffn_hidden_size": 4 * config.hidden_size,
    }
    for attribute, value in served.items():
        if getattr(config, attribute) != value:
            raise NotImplementedError(
                f"this Falcon checkpoint sets {attribute}={getattr(config, attribute)!r}; vlens "
                f"serves Falcon-7B's layout ({attribute}={value!r}) only, see mappings/falcon.py"
            )


def hook_specs(config: PretrainedConfig) -> dict[str, Spec]:
    check_served(config)
    eps = config.layer_norm_epsilon
    heads, kv_heads, d_head = attention_dimensions(config)
    d_model = config.hidden_size

    resid_pre = entering(LAYER, Argument(1, "hidden_states"))
    resid_final = entering("transformer.ln_f", Argument(0, "x"))
    d_mlp = 4 * d_model
    # Under tensor parallelism: each rank's query heads, the key/value head whole on every rank.
    qkv_split = Shards(-1, (d_model, d_head, d_head), replicated=(1, 2))
    qkv = leaving(f"{ATTN}.query_key_value", element=0, shards=qkv_split)
    q_heads, hidden_units = Shards(-1, (d_model,)), Shards(-1, (d_mlp,))
    k_end = d_model + d_head
    scale = d_head**-0.5
    explicit = ExplicitAttention(
        kernel=f"{ATTN}.attn",
        projection=f"{ATTN}.dense",
        heads=heads,
        kv_heads=kv_heads,
        d_head=d_head,
        scale=scale,
    )
    return {
        "hook_embed": leaving("transformer.word_embeddings"),
        f"{BLOCK}.hook_resid_pre": resid_pre,
        f"{BLOCK}.hook_attn_in": repeated_per_head(resid_pre, heads),
        f"{BLOCK}.hook_q_input": repeated_per_head(resid_pre, heads),
        f"{BLOCK}.hook_k_input": repeated_per_head(resid_pre, kv_heads, "kv_head"),
        f"{BLOCK}.hook_v_input": repeated_per_head(resid_pre, kv_heads, "kv_head"),
        f"{BLOCK}.ln1.hook_scale": layer_norm_scale(resid_pre, eps),
        f"{BLOCK}.ln1.hook_normalized": layer_norm_normalized(resid_pre, eps),
        f"{BLOCK}.attn.hook_q": per_head(columns(qkv, 0, d_model, "pos"), d_head),
        f"{BLOCK}.attn.hook_k": per_head(columns(qkv, d_model, k_end, "pos"), d_head, "kv_head"),
        f"{BLOCK}.attn.hook_v": per_head(
            columns(qkv, k_end, k_end + d_head, "pos"), d_head, "kv_head"
        ),
        f"{BLOCK}.attn.hook_rot_q": per_head(
            entering(f"{ATTN}.attn", Argument(0, "query", q_heads)), d_head
        ),
        f"{BLOCK}.attn.hook_rot_k": per_head(
            entering(f"{ATTN}.attn", Argument(1, "key")), d_head, "kv_head"
        ),
        f"{BLOCK}.attn.hook_attn_scores": attention_scores(
            f"{BLOCK}.attn.hook_rot_q", f"{BLOCK}.attn.hook_rot_k", scale, explicit
        ),
        f"{BLOCK}.attn.hook_pattern": attention_pattern(f"{BLOCK}.attn.hook_attn_scores", explicit),
        f"{BLOCK}.attn.hook_z": per_head(
            entering(f"{ATTN}.dense", Argument(0, "input_", q_heads)), d_head
        ),
        f"{BLOCK}.attn.hook_result": head_results(
            f"{BLOCK}.attn.hook_z", f"{ATTN}.dense.weight", explicit
        ),
        f"{BLOCK}.hook_attn_out": leaving(ATTN, element=0, shards=PartialSums()),
        f"{BLOCK}.mlp.hook_pre": leaving(
            f"{MLP}.dense_h_to_4h", element=0, shards=hidden_units, shape="pos d_mlp"
        ),
        f"{BLOCK}.mlp.hook_post": entering(
            f"{MLP}.dense_4h_to_h", Argument(0, "input_", hidden_units), shape="pos d_mlp"
        ),
        f"{BLOCK}.hook_mlp_out": leaving(MLP, element=0, shards=PartialSums()),
        f"{BLOCK}.hook_resid_post": leaving(LAYER),
        "ln_final.hook_scale": layer_norm_scale(resid_final, eps),
        "ln_final.hook_normalized": layer_norm_normalized(resid_final, eps),
        "unembed.hook_out": logits(leaving("transformer.ln_f")),
    }


def tiny_config() -> PretrainedConfig:
    """Falcon-7B's layout: parallel block, one key/value head, rotary, no biases, tied."""
    return FalconConfig(
        **shared_settings(),
        hidden_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        max_position_embeddings=MAX_POSITIONS,
        layer_norm_epsilon=1e-5,
    )


WEIGHTS = WeightNames(
    normalization="LN",
    eps="layer_norm_epsilon",
    W_E="transformer.word_embeddings.weight",
    W_QKV=f"{ATTN}.query_key_value.weight",
    W_O=f"{ATTN}.dense.weight",
    W_in=f"{MLP}.dense_h_to_4h.weight",
    W_out=f"{MLP}.dense_4h_to_h.weight",
    ln1_w=f"{LAYER}.input_layernorm.weight",
    ln1_b=f"{LAYER}.input_layernorm.bias",
    ln_final_w="transformer.ln_f.weight",
    ln_final_b="transformer.ln_f.bias",
    W_U=("lm_head.weight", "transformer.word_embeddings.weight"),
)

MAPPING = ArchitectureMapping(
    architectures=("FalconForCausalLM",),
    hook_specs=hook_specs,
    weights=WEIGHTS,
    compiled_graph=True,
    tensor_parallel=True,
    unavailable=parallel_block_error,
    tiny_configs={"falcon": tiny_config},
    hf_recorder="hf_falcon",
)
