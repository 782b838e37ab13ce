"""GPT-2 (``GPT2LMHeadModel``) as vLLM builds it, in TransformerLens names.

No fused residual here: a block takes the residual stream and returns it, and every add is plain
Python. The embeddings and blocks, top to bottom (``transformer``; ``transformer.h.{layer}``)::

    hidden = wte(input_ids) + wpe(positions)    # hook_embed, hook_pos_embed
    block(hidden):                              # hidden = resid_pre
        residual = hidden
        hidden = ln_1(hidden)                   # LayerNorm, with weight and bias
        attn(hidden):
            qkv, _ = c_attn(hidden)             # [q | k | v] with biases, H·d_head each part
            q, k, v = qkv.chunk(3, dim=-1)
            z = attn(q, k, v)                   # [pos, H·d_head]
            out, _ = c_proj(z)                  # with b_O
        hidden = out + residual                 # resid_mid
        residual = hidden
        hidden = ln_2(hidden)
        mlp(hidden):
            x, _ = c_fc(hidden)                 # W_in x + b_in
            x = act(x)                          # GELU (tanh approximation)
            out, _ = c_proj(x)
        return residual + out                   # resid_post
    hidden = ln_f(hidden)                       # the logits processor applies lm_head (= wte)

``wte`` and ``wpe`` are called as modules inside ``GPT2Model.forward`` (whose own hooks never
fire), so ``hook_embed`` and ``hook_pos_embed`` are their outputs; layer 0's ``resid_pre`` is
their sum, the block's input. An edit of ``resid_pre`` (``resid_mid``) lands in the block's
(``ln_2``'s) input in place, and ``residual`` is that same tensor, so the skip path carries it too.

Conventions, TransformerLens's where it and HuggingFace differ in form:

- ``ln*.hook_scale`` is ``sqrt(var(x) + eps)`` of the centred residual and ``hook_normalized`` is
  ``(x - mean) / scale``, before the LayerNorm's weight and bias; both are computed from the
  norm's input with the config's eps (vLLM's LayerNorm never forms them).
- No rotary: attention scores are rebuilt from ``hook_q`` and ``hook_k`` with GPT-2's scale
  ``1/sqrt(d_head)``, masked to -inf (HuggingFace masks with the dtype's minimum instead; the
  pattern is the same). Where a hook function is on scores, pattern or per-head results, the
  worker computes that layer's attention from ``attn``'s inputs and writes z as its output;
  per-head results through ``c_proj``, whose bias is ``b_O``
  (:class:`~vlens.names.mapping.ExplicitAttention`).
- HuggingFace's checkpoint stores ``c_attn``, ``c_proj`` and ``c_fc`` as Conv1D, ``[in, out]``:
  per-head results read ``W_O`` transposed accordingly. vLLM transposes them when loading.
- ``hook_k_input``/``hook_v_input`` and ``hook_k``/``hook_v`` have every head (no grouped keys).
"""

from transformers import GPT2Config, PretrainedConfig

from vlens.mappings._tiny import MAX_POSITIONS, shared_settings
from vlens.names.mapping import (
    ArchitectureMapping,
    Argument,
    ExplicitAttention,
    Shards,
    Spec,
    attention_pattern,
    attention_scores,
    columns,
    conv1d_head_results,
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
ATTN = f"{LAYER}.attn"
MLP = f"{LAYER}.mlp"
BLOCK = "blocks.{layer}"


def hook_specs(config: PretrainedConfig) -> dict[str, Spec]:
    eps = config.layer_norm_epsilon
    heads, d_model = config.num_attention_heads, config.hidden_size
    d_head = d_model // heads

    resid_pre = entering(LAYER, Argument(0, "hidden_states"))
    resid_mid = entering(f"{LAYER}.ln_2", Argument(0, "x"))
    resid_final = entering("transformer.ln_f", Argument(0, "x"))
    d_mlp = config.n_inner or 4 * d_model
    # Under tensor parallelism each rank holds its heads of these, and its part of d_mlp.
    qkv = leaving(f"{ATTN}.c_attn", element=0, shards=Shards(-1, (d_model, d_model, d_model)))
    scale = d_head**-0.5
    explicit = ExplicitAttention(
        kernel=f"{ATTN}.attn",
        projection=f"{ATTN}.c_proj",
        heads=heads,
        kv_heads=heads,
        d_head=d_head,
        scale=scale,
    )
    return {
        "hook_embed": leaving("transformer.wte"),
        "hook_pos_embed": leaving("transformer.wpe"),
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
            f"{BLOCK}.attn.hook_q", f"{BLOCK}.attn.hook_k", scale, explicit
        ),
        f"{BLOCK}.attn.hook_pattern": attention_pattern(f"{BLOCK}.attn.hook_attn_scores", explicit),
        f"{BLOCK}.attn.hook_z": per_head(
            entering(f"{ATTN}.c_proj", Argument(0, "input_", Shards(-1, (d_model,)))), d_head
        ),
        f"{BLOCK}.attn.hook_result": conv1d_head_results(
            f"{BLOCK}.attn.hook_z",
            f"{LAYER}.attn.c_proj.weight",
            "h.{layer}.attn.c_proj.weight",
            explicit=explicit,
        ),
        f"{BLOCK}.hook_attn_out": leaving(ATTN),
        f"{BLOCK}.hook_resid_mid": resid_mid,
        f"{BLOCK}.hook_mlp_in": resid_mid,
        f"{BLOCK}.ln2.hook_scale": layer_norm_scale(resid_mid, eps),
        f"{BLOCK}.ln2.hook_normalized": layer_norm_normalized(resid_mid, eps),
        f"{BLOCK}.mlp.hook_pre": leaving(
            f"{MLP}.c_fc", element=0, shape="pos d_mlp", shards=Shards(-1, (d_mlp,))
        ),
        f"{BLOCK}.mlp.hook_post": entering(
            f"{MLP}.c_proj", Argument(0, "input_", Shards(-1, (d_mlp,))), shape="pos d_mlp"
        ),
        f"{BLOCK}.hook_mlp_out": leaving(MLP),
        f"{BLOCK}.hook_resid_post": leaving(LAYER),
        "ln_final.hook_scale": layer_norm_scale(resid_final, eps),
        "ln_final.hook_normalized": layer_norm_normalized(resid_final, eps),
        "unembed.hook_out": logits(leaving("transformer.ln_f")),
    }


def tiny_config() -> PretrainedConfig:
    """GPT-2: LayerNorm, learned positions, fused qkv with biases, always-tied unembedding."""
    return GPT2Config(
        **shared_settings(),
        n_embd=128,
        n_layer=3,
        n_head=4,
        n_positions=MAX_POSITIONS,
        layer_norm_epsilon=1e-5,
    )


WEIGHTS = WeightNames(
    normalization="LN",
    eps="layer_norm_epsilon",
    W_E="transformer.wte.weight",
    W_pos="transformer.wpe.weight",
    W_QKV=f"{ATTN}.c_attn.weight",
    b_QKV=f"{ATTN}.c_attn.bias",
    W_O=f"{ATTN}.c_proj.weight",
    b_O=f"{ATTN}.c_proj.bias",
    W_in=f"{MLP}.c_fc.weight",
    b_in=f"{MLP}.c_fc.bias",
    W_out=f"{MLP}.c_proj.weight",
    b_out=f"{MLP}.c_proj.bias",
    ln1_w=f"{LAYER}.ln_1.weight",
    ln1_b=f"{LAYER}.ln_1.bias",
    ln2_w=f"{LAYER}.ln_2.weight",
    ln2_b=f"{LAYER}.ln_2.bias",
    ln_final_w="transformer.ln_f.weight",
    ln_final_b="transformer.ln_f.bias",
    W_U=("lm_head.weight", "transformer.wte.weight"),
    conv1d=True,
    optional_prefix="transformer.",
)

MAPPING = ArchitectureMapping(
    architectures=("GPT2LMHeadModel",),
    hook_specs=hook_specs,
    weights=WEIGHTS,
    compiled_graph=True,
    tensor_parallel=True,
    tiny_configs={"gpt2": tiny_config},
    hf_recorder="hf_gpt2",
)
