"""GPT-J (``GPTJForCausalLM``) as vLLM builds it, in TransformerLens names.

Attention and MLP in parallel on one LayerNorm's output, added to the residual together; no
fused residual, every add plain Python. The model and one block (``transformer``;
``transformer.h.{layer}``, called ``block(positions, hidden)``, returning the stream)::

    hidden = wte(input_ids)                     # hook_embed (no learned positions)
    block(positions, hidden):                   # hidden = resid_pre
        residual = hidden
        hidden = ln_1(hidden)                   # LayerNorm, with weight and bias
        attn(positions, hidden):
            qkv, _ = qkv_proj(hidden)           # [q | k | v], H·d_head each part, no biases
            q, k, v = qkv.chunk(3, dim=-1)
            q, k = rotary_emb(positions, q, k)  # first rotary_dim features of each head,
                                                # rotated in pairs (GPT-J's interleaved rotary)
            z = attn(q, k, v)
            out, _ = out_proj(z)                # no bias
        mlp(hidden):                            # the same normed input
            x, _ = fc_in(hidden)                # W_in x + b_in
            x = act(x)                          # gelu_new
            out, _ = fc_out(x)
        return attn_out + mlp_out + residual    # resid_post
    hidden = ln_f(hidden)                       # logits: lm_head, with its bias (b_U)

As in TransformerLens's bridge for a block with one norm before both halves, there is no
``hook_resid_mid``, ``hook_mlp_in`` or ``ln2``: the MLP reads ``ln1``'s output. ``hook_rot_q``
and ``hook_rot_k`` are whole heads, read where ``attn`` receives them (the features past
``rotary_dim`` as they left the projection). Scores are rebuilt from them with
``1/sqrt(d_head)``; where a hook function is on scores, pattern or per-head results, the worker
computes that layer's attention from ``attn``'s inputs and writes z as its output; per-head
results through ``out_proj`` (:class:`~vlens.names.mapping.ExplicitAttention`).
"""

from transformers import GPTJConfig, PretrainedConfig

from vlens.mappings._tiny import MAX_POSITIONS, shared_settings
from vlens.names.mapping import (
    ArchitectureMapping,
    Argument,
    ExplicitAttention,
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
ATTN = f"{LAYER}.attn"
MLP = f"{LAYER}.mlp"
BLOCK = "blocks.{layer}"
#: Why TransformerLens's bridge gives no reference where its adapter wraps the attention in a plain
#: ``AttentionBridge`` (GPT-J, OPT).
PLAIN_ATTENTION_BRIDGE = (
    "TransformerLens's bridge refuses per-head results and split q/k/v inputs for this "
    "architecture's attention (its plain AttentionBridge supports neither set_use_attn_result "
    "nor set_use_split_qkv_input)"
)


def hook_specs(config: PretrainedConfig) -> dict[str, Spec]:
    eps = config.layer_norm_epsilon
    heads, _, d_head = attention_dimensions(config)
    d_model = config.hidden_size

    resid_pre = entering(LAYER, Argument(1, "hidden_states"))
    resid_final = entering("transformer.ln_f", Argument(0, "x"))
    d_mlp = config.n_inner or 4 * d_model
    # Under tensor parallelism each rank holds its heads of these, and its part of d_mlp.
    heads_split, mlp_split = Shards(-1, (d_model,)), Shards(-1, (d_mlp,))
    qkv = leaving(f"{ATTN}.qkv_proj", element=0, shards=Shards(-1, (d_model, d_model, d_model)))
    scale = d_head**-0.5
    explicit = ExplicitAttention(
        kernel=f"{ATTN}.attn",
        projection=f"{ATTN}.out_proj",
        heads=heads,
        kv_heads=heads,
        d_head=d_head,
        scale=scale,
    )
    return {
        "hook_embed": leaving("transformer.wte"),
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
        f"{BLOCK}.attn.hook_rot_q": per_head(
            entering(f"{ATTN}.attn", Argument(0, "query", heads_split)), d_head
        ),
        f"{BLOCK}.attn.hook_rot_k": per_head(
            entering(f"{ATTN}.attn", Argument(1, "key", heads_split)), d_head
        ),
        f"{BLOCK}.attn.hook_attn_scores": attention_scores(
            f"{BLOCK}.attn.hook_rot_q", f"{BLOCK}.attn.hook_rot_k", scale, explicit
        ),
        f"{BLOCK}.attn.hook_pattern": attention_pattern(f"{BLOCK}.attn.hook_attn_scores", explicit),
        f"{BLOCK}.attn.hook_z": per_head(
            entering(f"{ATTN}.out_proj", Argument(0, "input_", heads_split)), d_head
        ),
        f"{BLOCK}.attn.hook_result": head_results(
            f"{BLOCK}.attn.hook_z", f"{ATTN}.out_proj.weight", explicit
        ),
        f"{BLOCK}.hook_attn_out": leaving(ATTN),
        f"{BLOCK}.mlp.hook_pre": leaving(f"{MLP}.fc_in", element=0, shape="pos d_mlp",
                                         shards=mlp_split),
        f"{BLOCK}.mlp.hook_post": entering(f"{MLP}.fc_out", Argument(0, "input_", mlp_split),
                                           shape="pos d_mlp"),
        f"{BLOCK}.hook_mlp_out": leaving(MLP),
        f"{BLOCK}.hook_resid_post": leaving(LAYER),
        "ln_final.hook_scale": layer_norm_scale(resid_final, eps),
        "ln_final.hook_normalized": layer_norm_normalized(resid_final, eps),
        "unembed.hook_out": logits(leaving("transformer.ln_f")),
    }


def parallel_block_error(name: str) -> str | None:
    """Why a sequential block's names between attention and MLP are missing."""
    if not name.endswith(("hook_resid_mid", "hook_mlp_in", "ln2.hook_scale", "ln2.hook_normalized")):
        return None
    return (
        f"{name!r}: attention and MLP run in parallel on ln1's output and are added to the "
        f"residual together, so there is no stream between them and no second norm; "
        f"ln1.hook_normalized is the MLP's input, hook_resid_pre the stream it reads"
    )


def tiny_config() -> PretrainedConfig:
    """GPT-J: 4 heads of 32, the first half of each rotated, untied unembedding with a bias;
    the MLP 4·d_model wide (``n_inner`` unset), as in GPT-J 6B."""
    return GPTJConfig(
        **shared_settings(),
        n_embd=128,
        n_layer=3,
        n_head=4,
        rotary_dim=16,
        n_positions=MAX_POSITIONS,
        layer_norm_epsilon=1e-5,
        tie_word_embeddings=False,
    )


WEIGHTS = WeightNames(
    normalization="LN",
    eps="layer_norm_epsilon",
    W_E="transformer.wte.weight",
    W_Q=f"{ATTN}.q_proj.weight",
    W_K=f"{ATTN}.k_proj.weight",
    W_V=f"{ATTN}.v_proj.weight",
    W_O=f"{ATTN}.out_proj.weight",
    W_in=f"{MLP}.fc_in.weight",
    b_in=f"{MLP}.fc_in.bias",
    W_out=f"{MLP}.fc_out.weight",
    b_out=f"{MLP}.fc_out.bias",
    ln1_w=f"{LAYER}.ln_1.weight",
    ln1_b=f"{LAYER}.ln_1.bias",
    ln_final_w="transformer.ln_f.weight",
    ln_final_b="transformer.ln_f.bias",
    W_U=("lm_head.weight",),
    b_U="lm_head.bias",
)

MAPPING = ArchitectureMapping(
    architectures=("GPTJForCausalLM",),
    hook_specs=hook_specs,
    weights=WEIGHTS,
    compiled_graph=True,
    tensor_parallel=True,
    unavailable=parallel_block_error,
    tiny_configs={"gptj": tiny_config},
    hf_recorder="hf_gptj",
    no_bridge_reference=PLAIN_ATTENTION_BRIDGE,
)
