"""OPT (``OPTForCausalLM``) as vLLM builds it, in TransformerLens names.

GPT-2's shape with separate q/k/v projections (fused by vLLM into ``qkv_proj``), the MLP's
projections directly in the layer and learned positions offset by two. No fused residual: every
add is plain Python. The decoder and one layer (``model.decoder``;
``model.decoder.layers.{layer}``, called ``layer(hidden)``, returning the stream)::

    hidden = embed_tokens(ids) + embed_positions(positions)  # hook_embed, hook_pos_embed
                                                             # (embed_positions reads row pos+2)
    layer(hidden):                                           # hidden = resid_pre
        residual = hidden
        hidden = self_attn_layer_norm(hidden)                # LayerNorm, eps 1e-5
        self_attn(hidden):
            qkv, _ = qkv_proj(hidden)                        # [q | k | v], with biases
            q, k, v = qkv.chunk(3, dim=-1)
            z = attn(q, k, v)                                # scale 1/sqrt(d_head)
            out, _ = out_proj(z)                             # with b_O
        hidden = residual + out                              # resid_mid
        residual = hidden
        hidden = final_layer_norm(hidden)                    # the layer's second LayerNorm
        x, _ = fc1(hidden)                                   # hook_pre
        x = activation_fn(x)                                 # ReLU
        out, _ = fc2(x)                                      # hook_post in, hook_mlp_out out
        return residual + out                                # resid_post
    hidden = final_layer_norm(hidden)                        # the decoder's; logits: lm_head

``hook_mlp_out`` is ``fc2``'s output (OPT has no MLP module). No rotary: scores are rebuilt from
``hook_q`` and ``hook_k``; where a hook function is on scores, pattern or per-head results, the
worker computes that layer's attention from ``attn``'s inputs and writes z as its output;
per-head results through ``out_proj`` (:class:`~vlens.names.mapping.ExplicitAttention`).
HuggingFace multiplies q by ``1/sqrt(d_head)`` before the scores and vLLM inside its kernel;
``hook_q`` is q as ``q_proj`` gives it, unscaled, as in TransformerLens.

Only OPT's pre-norm layout is served: checkpoints with ``do_layer_norm_before=False`` (OPT-350m:
each norm after its residual add) or with ``project_in``/``project_out`` (``word_embed_proj_dim``
unlike ``hidden_size``) are refused, since the names above would not mean TransformerLens's there.
"""

from transformers import OPTConfig, PretrainedConfig

from vlens.mappings._tiny import MAX_POSITIONS, shared_settings
from vlens.mappings.gptj import PLAIN_ATTENTION_BRIDGE
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

DECODER = "model.decoder"
LAYER = f"{DECODER}.layers.{{layer}}"
ATTN = f"{LAYER}.self_attn"
BLOCK = "blocks.{layer}"
#: torch's LayerNorm default, which both HuggingFace's and vLLM's OPT use (the config has none).
EPS = 1e-5


def check_served(config: PretrainedConfig) -> None:
    """Refuse the layouts this mapping does not name (see the module's docstring)."""
    if not config.do_layer_norm_before:
        raise NotImplementedError(
            "this OPT checkpoint normalises after each residual add (do_layer_norm_before=False, "
            "as OPT-350m), where TransformerLens's resid/ln names would not read what they say; "
            "only pre-norm OPT checkpoints are served"
        )
    if config.word_embed_proj_dim != config.hidden_size:
        raise NotImplementedError(
            "this OPT checkpoint projects its embeddings in and out (word_embed_proj_dim "
            f"{config.word_embed_proj_dim} ≠ hidden_size {config.hidden_size}), which this "
            "mapping does not name; only checkpoints without project_in/project_out are served"
        )


def hook_specs(config: PretrainedConfig) -> dict[str, Spec]:
    check_served(config)
    heads, _, d_head = attention_dimensions(config)
    d_model = config.hidden_size

    resid_pre = entering(LAYER, Argument(0, "hidden_states"))
    resid_mid = entering(f"{LAYER}.final_layer_norm", Argument(0, "x"))
    resid_final = entering(f"{DECODER}.final_layer_norm", Argument(0, "x"))
    d_mlp = config.ffn_dim
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
        "hook_embed": leaving(f"{DECODER}.embed_tokens"),
        "hook_pos_embed": leaving(f"{DECODER}.embed_positions"),
        f"{BLOCK}.hook_resid_pre": resid_pre,
        f"{BLOCK}.hook_attn_in": repeated_per_head(resid_pre, heads),
        f"{BLOCK}.hook_q_input": repeated_per_head(resid_pre, heads),
        f"{BLOCK}.hook_k_input": repeated_per_head(resid_pre, heads),
        f"{BLOCK}.hook_v_input": repeated_per_head(resid_pre, heads),
        f"{BLOCK}.ln1.hook_scale": layer_norm_scale(resid_pre, EPS),
        f"{BLOCK}.ln1.hook_normalized": layer_norm_normalized(resid_pre, EPS),
        f"{BLOCK}.attn.hook_q": per_head(columns(qkv, 0, d_model, "pos"), d_head),
        f"{BLOCK}.attn.hook_k": per_head(columns(qkv, d_model, 2 * d_model, "pos"), d_head),
        f"{BLOCK}.attn.hook_v": per_head(columns(qkv, 2 * d_model, 3 * d_model, "pos"), d_head),
        f"{BLOCK}.attn.hook_attn_scores": attention_scores(
            f"{BLOCK}.attn.hook_q", f"{BLOCK}.attn.hook_k", scale, explicit
        ),
        f"{BLOCK}.attn.hook_pattern": attention_pattern(f"{BLOCK}.attn.hook_attn_scores", explicit),
        f"{BLOCK}.attn.hook_z": per_head(
            entering(f"{ATTN}.out_proj", Argument(0, "input_", heads_split)), d_head
        ),
        f"{BLOCK}.attn.hook_result": head_results(
            f"{BLOCK}.attn.hook_z", f"{ATTN}.out_proj.weight", explicit
        ),
        f"{BLOCK}.hook_attn_out": leaving(ATTN),
        f"{BLOCK}.hook_resid_mid": resid_mid,
        f"{BLOCK}.hook_mlp_in": resid_mid,
        f"{BLOCK}.ln2.hook_scale": layer_norm_scale(resid_mid, EPS),
        f"{BLOCK}.ln2.hook_normalized": layer_norm_normalized(resid_mid, EPS),
        f"{BLOCK}.mlp.hook_pre": leaving(f"{LAYER}.fc1", element=0, shape="pos d_mlp",
                                         shards=mlp_split),
        f"{BLOCK}.mlp.hook_post": entering(f"{LAYER}.fc2", Argument(0, "input_", mlp_split),
                                           shape="pos d_mlp"),
        f"{BLOCK}.hook_mlp_out": leaving(f"{LAYER}.fc2", element=0),
        f"{BLOCK}.hook_resid_post": leaving(LAYER),
        "ln_final.hook_scale": layer_norm_scale(resid_final, EPS),
        "ln_final.hook_normalized": layer_norm_normalized(resid_final, EPS),
        "unembed.hook_out": logits(leaving(f"{DECODER}.final_layer_norm")),
    }


def tiny_config() -> PretrainedConfig:
    """OPT: pre-norm, biases everywhere, ReLU, an MLP 4·d_model wide, tied unembedding."""
    return OPTConfig(
        **shared_settings(),
        hidden_size=128,
        word_embed_proj_dim=128,
        ffn_dim=512,
        num_hidden_layers=3,
        num_attention_heads=4,
        max_position_embeddings=MAX_POSITIONS,
        do_layer_norm_before=True,
        activation_function="relu",
        tie_word_embeddings=True,
    )


WEIGHTS = WeightNames(
    normalization="LN",
    eps=EPS,
    W_E=f"{DECODER}.embed_tokens.weight",
    W_pos=f"{DECODER}.embed_positions.weight",
    W_Q=f"{ATTN}.q_proj.weight",
    W_K=f"{ATTN}.k_proj.weight",
    W_V=f"{ATTN}.v_proj.weight",
    b_Q=f"{ATTN}.q_proj.bias",
    b_K=f"{ATTN}.k_proj.bias",
    b_V=f"{ATTN}.v_proj.bias",
    W_O=f"{ATTN}.out_proj.weight",
    b_O=f"{ATTN}.out_proj.bias",
    W_in=f"{LAYER}.fc1.weight",
    b_in=f"{LAYER}.fc1.bias",
    W_out=f"{LAYER}.fc2.weight",
    b_out=f"{LAYER}.fc2.bias",
    ln1_w=f"{LAYER}.self_attn_layer_norm.weight",
    ln1_b=f"{LAYER}.self_attn_layer_norm.bias",
    ln2_w=f"{LAYER}.final_layer_norm.weight",
    ln2_b=f"{LAYER}.final_layer_norm.bias",
    ln_final_w=f"{DECODER}.final_layer_norm.weight",
    ln_final_b=f"{DECODER}.final_layer_norm.bias",
    W_U=("lm_head.weight", f"{DECODER}.embed_tokens.weight"),
)

MAPPING = ArchitectureMapping(
    architectures=("OPTForCausalLM",),
    hook_specs=hook_specs,
    weights=WEIGHTS,
    compiled_graph=True,
    tensor_parallel=True,
    tiny_configs={"opt": tiny_config},
    hf_recorder="hf_opt",
    no_bridge_reference=PLAIN_ATTENTION_BRIDGE,
)
