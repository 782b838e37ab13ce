"""EXAONE 4.0 (``Exaone4ForCausalLM``) as vLLM builds it, in TransformerLens names.

Llama's attention and gated MLP modules (``llama.py``: ``qkv_proj``, ``rotary_emb``, ``attn``,
``o_proj``; ``gate_up_proj``, ``down_proj``) with no norm before either sublayer: each sublayer's
output is normed before the residual add (OLMo-2's block), q and k are normed per head (Qwen3's),
and layers alternate between sliding-window attention with rotary positions and full attention
without them. One layer (``model.layers.{layer}``, called ``layer(positions, hidden, residual)``;
the residual argument is not read)::

    residual = hidden                                   # resid_pre
    self_attn(positions, hidden):
        q, k, v = qkv_proj(hidden)[0].split(...)
        q = q_norm(q.view(pos, H, d_head))              # attn.hook_q_normed
        k = k_norm(k.view(pos, Hkv, d_head))            # attn.hook_k_normed
        if sliding layer (or no layer slides):
            q, k = rotary_emb(positions, q, k)          # attn.hook_rot_q, attn.hook_rot_k
        z = attn(q, k, v)                               # window of sliding_window keys, or all
        attn_out = o_proj(z)
    hidden = residual + post_attention_layernorm(attn_out)      # ln1_post → hook_attn_out
    residual = hidden                                   # resid_mid
    hidden = hidden + post_feedforward_layernorm(mlp(hidden))   # ln2_post → hook_mlp_out
    return hidden, residual                             # resid_post is the first

After the last layer ``model.norm(hidden)`` gives what ``lm_head`` unembeds. As in TransformerLens's
bridge (its OLMo-2 adapter), there is no ``ln1`` or ``ln2``; ``ln1_post``/``ln2_post`` are the
norms after the sublayers and ``hook_attn_out``/``hook_mlp_out`` their outputs, the terms the
stream receives. ``hook_resid_mid``/``hook_mlp_in`` are read as the MLP's input: a hook writing
them changes what the MLP reads, not the stream the MLP's term is added to (the add is no
module). On full-attention layers of a hybrid model ``hook_rot_q``/``hook_rot_k`` equal the normed
q and k (no rotation). Scores and patterns are rebuilt with each layer's window; hooks on them and
on per-head results cannot run explicitly.

Configs where vLLM and HuggingFace choose the rotated layers differently are refused (a
``sliding_window`` with no sliding layer: vLLM rotates every layer, HuggingFace none; sliding layers
without a ``sliding_window``: vLLM rotates none, HuggingFace every one).
"""

from dataclasses import replace

from transformers import Exaone4Config, PretrainedConfig

from vlens.mappings._tiny import rotary_dims
from vlens.mappings.gemma2 import LayerAttentionScores, layer_windows
from vlens.mappings.llama import (
    ATTN,
    BLOCK,
    LAYER,
    MLP,
    ResidualStream,
    decoder_specs,
)
from vlens.mappings.llama import WEIGHTS as LLAMA_WEIGHTS
from vlens.names.mapping import (
    ArchitectureMapping,
    Argument,
    DerivedSpec,
    NoExplicitAttention,
    Shards,
    Spec,
    attention_dimensions,
    attention_pattern,
    entering,
    head_results,
    heads_first,
    leaving,
    names_after,
    rms_normalized,
    rms_scale,
)

#: Shorter than most parity prompts, so that the window is exercised.
TINY_WINDOW = 8

NOT_EXPLICIT = NoExplicitAttention(
    "EXAONE 4 attends over a sliding window on some layers, which vlens's explicit attention does "
    "not compute; hook attn.hook_rot_q, attn.hook_rot_k, attn.hook_v or attn.hook_z instead"
)

#: The names of a block with norms before its sublayers, which this block has not.
PRE_NORM_ONLY = ("ln1.hook_scale", "ln1.hook_normalized", "ln2.hook_scale", "ln2.hook_normalized")


def residual_stream(eps: float) -> ResidualStream:
    """The stream as the layer's argument, the MLP's input, the layer's first result and the
    final norm's input (no fused add)."""
    return ResidualStream(
        pre=entering(LAYER, Argument(1, "hidden_states")),
        mid=entering(MLP, Argument(0, "x")),
        post=leaving(LAYER, element=0),
        final=entering("model.norm", Argument(0, "x")),
        final_normed=leaving("model.norm"),
        eps=eps,
    )


def check_rotary_layers(config: PretrainedConfig) -> None:
    """Refuse a config whose rotated layers vLLM and HuggingFace would choose differently."""
    sliding = "sliding_attention" in config.layer_types
    if sliding != (config.sliding_window is not None):
        raise NotImplementedError(
            f"this EXAONE 4 config has sliding_window={config.sliding_window} with layer_types "
            f"{sorted(set(config.layer_types))}: vLLM and HuggingFace rotate different layers of "
            f"such a model, so its names would not be HuggingFace's; set sliding_window only "
            f"where some layer is sliding_attention"
        )


def hook_specs(config: PretrainedConfig) -> dict[str, Spec]:
    check_rotary_layers(config)
    eps = config.rms_norm_eps
    heads, kv_heads, d_head = attention_dimensions(config)
    specs = decoder_specs(config, residual_stream(eps))
    for name in PRE_NORM_ONLY:
        del specs[f"{BLOCK}.{name}"]
    attn_raw = entering(f"{LAYER}.post_attention_layernorm", Argument(0, "x"))
    mlp_raw = entering(f"{LAYER}.post_feedforward_layernorm", Argument(0, "x"))
    q_normed = leaving(f"{ATTN}.q_norm", shards=Shards(-2, (heads,)))
    k_normed = leaving(f"{ATTN}.k_norm", shards=Shards(-2, (kv_heads,)))
    scores = DerivedSpec(
        (f"{BLOCK}.attn.hook_rot_q", f"{BLOCK}.attn.hook_rot_k"),
        LayerAttentionScores(d_head**-0.5, None, layer_windows(config)),
        "head query_pos key_pos",
        hookable=NOT_EXPLICIT,
    )
    specs.update({
        f"{BLOCK}.attn.hook_result": head_results(
            f"{BLOCK}.attn.hook_z", f"{ATTN}.o_proj.weight", NOT_EXPLICIT
        ),
        f"{BLOCK}.hook_attn_out": leaving(f"{LAYER}.post_attention_layernorm"),
        f"{BLOCK}.hook_mlp_out": leaving(f"{LAYER}.post_feedforward_layernorm"),
    })
    specs.pop(f"{BLOCK}.attn.hook_attn_scores", None)
    specs.pop(f"{BLOCK}.attn.hook_pattern", None)
    specs = names_after(specs, f"{BLOCK}.attn.hook_v", {
        f"{BLOCK}.attn.hook_q_normed": heads_first(q_normed),
        f"{BLOCK}.attn.hook_k_normed": heads_first(k_normed, "kv_head"),
    })
    specs = names_after(specs, f"{BLOCK}.attn.hook_rot_k", {
        f"{BLOCK}.attn.hook_attn_scores": scores,
        f"{BLOCK}.attn.hook_pattern": attention_pattern(
            f"{BLOCK}.attn.hook_attn_scores", NOT_EXPLICIT
        ),
    })
    specs = names_after(specs, f"{BLOCK}.attn.hook_result", {
        f"{BLOCK}.ln1_post.hook_scale": rms_scale(attn_raw, eps),
        f"{BLOCK}.ln1_post.hook_normalized": rms_normalized(attn_raw, eps),
    })
    return names_after(specs, f"{BLOCK}.mlp.hook_post", {
        f"{BLOCK}.ln2_post.hook_scale": rms_scale(mlp_raw, eps),
        f"{BLOCK}.ln2_post.hook_normalized": rms_normalized(mlp_raw, eps),
    })


def pre_norm_error(name: str) -> str | None:
    """Why ``ln1``/``ln2`` names are missing; None for any other name."""
    if not any(name.endswith(f".{missing}") for missing in PRE_NORM_ONLY):
        return None
    return (
        f"{name!r}: EXAONE 4 norms each sublayer's output, not its input, so it has no ln1 or "
        f"ln2; ln1_post and ln2_post are its norms (as in TransformerLens)"
    )


def tiny_config() -> PretrainedConfig:
    """EXAONE 4: windowed layers with rotary positions around a full one without, untied
    unembedding."""
    return Exaone4Config(
        **rotary_dims(),
        head_dim=32,
        rms_norm_eps=1e-5,
        sliding_window=TINY_WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        tie_word_embeddings=False,
    )


#: Llama's checkpoint names without norms before the sublayers (the post-norms are not among the
#: weight views, as in OLMo-2's).
WEIGHTS = replace(LLAMA_WEIGHTS, ln1_w=None, ln2_w=None)

MAPPING = ArchitectureMapping(
    architectures=("Exaone4ForCausalLM",),
    hook_specs=hook_specs,
    weights=WEIGHTS,
    unavailable=pre_norm_error,
    compiled_graph=True,
    tensor_parallel=True,
    tiny_configs={"exaone4": tiny_config},
    hf_recorder="hf_exaone4",
)
