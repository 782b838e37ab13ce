"""Llama (``LlamaForCausalLM``) as vLLM builds it, in TransformerLens names.

vLLM fuses each residual add into the RMSNorm that follows it. One decoder layer, top to bottom
(``model.layers.{layer}``, called as ``layer(positions, hidden, residual)``)::

    hidden, residual = input_layernorm(hidden, residual)    # residual ← hidden + residual
                                                            # (layer 0: residual ← hidden)
    self_attn(positions=..., hidden_states=hidden):
        qkv, _ = qkv_proj(hidden)                           # [q | k | v], heads·d_head each part
        q, k = rotary_emb(positions, q, k)                  # rotates q and k in place
        z = attn(q, k, v)                                   # [pos, H·d_head]
        hidden, _ = o_proj(z)
    hidden, residual = post_attention_layernorm(hidden, residual)
    mlp(hidden):
        x, _ = gate_up_proj(hidden)                         # [gate | up]
        x = act_fn(x)                                       # silu(gate) · up
        hidden, _ = down_proj(x)
    return hidden, residual                                 # the stream leaving is their sum

After the last layer ``model.norm(hidden, residual)`` adds them once more and normalises; the
logits processor applies ``lm_head`` to its first output. Attention scores and patterns are
rebuilt from the rotated q and k (vLLM never forms them); per-head results use the checkpoint's
``o_proj`` weight. Where a hook function is on them, the worker computes that layer's attention
from ``attn``'s inputs (q and k rotated, v) and writes z as ``attn``'s output; per-head results
through ``o_proj`` (:class:`~vlens.names.mapping.ExplicitAttention`).

Where the config sets a ``sliding_window`` shorter than its context (Mistral-7B-v0.1), vLLM
attends over that window on every layer; scores and patterns rebuilt with full causal attention
would be wrong past it, so they are not offered there (:func:`windowed_name_error`), and hooks on
per-head results cannot run explicitly.

Other members of the family (``qwen3.py``, ``mistral.py``, ``qwen2.py``) are this mapping with
their differences (:meth:`~vlens.names.mapping.ArchitectureMapping.member`).
"""

import re
from collections.abc import Callable
from dataclasses import dataclass

from transformers import LlamaConfig, PretrainedConfig

from vlens.mappings._tiny import rotary_dims
from vlens.names.mapping import (
    ArchitectureMapping,
    Argument,
    ExplicitAttention,
    HookSpec,
    NoExplicitAttention,
    Shards,
    Spec,
    attention_dimensions,
    attention_pattern,
    attention_scores,
    columns,
    entering,
    head_results,
    heads_first,
    leaving,
    logits,
    per_head,
    repeated_per_head,
    rms_normalized,
    rms_scale,
)
from vlens.names.weights import WeightNames

LAYER = "model.layers.{layer}"
ATTN = f"{LAYER}.self_attn"
MLP = f"{LAYER}.mlp"
BLOCK = "blocks.{layer}"


def sliding_window(config: PretrainedConfig) -> int | None:
    """The window vLLM's attention keeps on every layer (``config.sliding_window``), or None
    where attention is fully causal (no window, or one as long as the context)."""
    window = getattr(config, "sliding_window", None)
    return window if window is not None and window < config.max_position_embeddings else None


@dataclass(frozen=True)
class ResidualStream:
    """Where a Llama-shaped decoder's residual stream is read, and how its norms read it: the
    stream entering a layer (``pre``), its norms (``mid``, ``final``) and leaving it (``post``);
    the final norm's output (``final_normed``, what the logits are computed from); ``scale`` and
    ``normalized`` make TransformerLens's ``hook_scale``/``hook_normalized`` of a norm's input."""

    pre: HookSpec
    mid: HookSpec
    post: HookSpec
    final: HookSpec
    final_normed: HookSpec
    eps: float
    scale: Callable[[HookSpec, float], HookSpec] = rms_scale
    normalized: Callable[[HookSpec, float], HookSpec] = rms_normalized


def fused_residual(eps: float) -> ResidualStream:
    """vLLM's Llama residual: each add fused into the RMSNorm that follows it (see above)."""
    return ResidualStream(
        pre=entering(LAYER, Argument(1, "hidden_states"), plus=Argument(2, "residual")),
        mid=entering(
            f"{LAYER}.post_attention_layernorm", Argument(0, "x"), plus=Argument(1, "residual")
        ),
        post=leaving(LAYER, element=0, plus=1),
        final=entering("model.norm", Argument(0, "x"), plus=Argument(1, "residual")),
        final_normed=leaving("model.norm", element=0),
        eps=eps,
    )


def hook_specs(config: PretrainedConfig) -> dict[str, Spec]:
    return decoder_specs(config, fused_residual(config.rms_norm_eps))


def decoder_specs(config: PretrainedConfig, stream: ResidualStream) -> dict[str, Spec]:
    """Every name of a decoder with Llama's attention and gated MLP modules, whose residual
    stream is read as ``stream`` says."""
    eps, norm_scale, normalized = stream.eps, stream.scale, stream.normalized
    heads, kv_heads, d_head = attention_dimensions(config)
    q_end, k_end, v_end = heads * d_head, (heads + kv_heads) * d_head, (heads + 2 * kv_heads) * d_head
    d_mlp = config.intermediate_size

    resid_pre, resid_mid, resid_final = stream.pre, stream.mid, stream.final
    # Under tensor parallelism each rank holds its heads of these, and its part of d_mlp.
    q_heads, kv_heads_split = Shards(-1, (q_end,)), Shards(-1, (k_end - q_end,))
    qkv = leaving(f"{ATTN}.qkv_proj", element=0, shards=Shards(-1, (q_end, k_end - q_end, v_end - k_end)))
    gate_up = leaving(f"{MLP}.gate_up_proj", element=0, shards=Shards(-1, (d_mlp, d_mlp)))
    z = entering(f"{ATTN}.o_proj", Argument(0, "input_", q_heads))
    post = entering(f"{MLP}.down_proj", Argument(0, "input_", Shards(-1, (d_mlp,))), shape="pos d_mlp")
    explicit: ExplicitAttention | NoExplicitAttention = explicit_attention(config)
    scale = explicit.scale
    window = sliding_window(config)
    if window is not None:
        explicit = NoExplicitAttention(
            f"vLLM attends over a sliding window of {window} tokens (config.sliding_window), "
            f"which vlens does not compute attention with; hook attn.hook_z instead"
        )
    specs = {
        "hook_embed": leaving("model.embed_tokens"),
        f"{BLOCK}.hook_resid_pre": resid_pre,
        f"{BLOCK}.hook_attn_in": repeated_per_head(resid_pre, heads),
        f"{BLOCK}.hook_q_input": repeated_per_head(resid_pre, heads),
        f"{BLOCK}.hook_k_input": repeated_per_head(resid_pre, kv_heads, "kv_head"),
        f"{BLOCK}.hook_v_input": repeated_per_head(resid_pre, kv_heads, "kv_head"),
        f"{BLOCK}.ln1.hook_scale": norm_scale(resid_pre, eps),
        f"{BLOCK}.ln1.hook_normalized": normalized(resid_pre, eps),
        f"{BLOCK}.attn.hook_q": per_head(columns(qkv, 0, q_end, "pos"), d_head),
        f"{BLOCK}.attn.hook_k": per_head(columns(qkv, q_end, k_end, "pos"), d_head, "kv_head"),
        f"{BLOCK}.attn.hook_v": per_head(columns(qkv, k_end, v_end, "pos"), d_head, "kv_head"),
        f"{BLOCK}.attn.hook_rot_q": per_head(
            entering(f"{ATTN}.attn", Argument(0, "query", q_heads)), d_head
        ),
        f"{BLOCK}.attn.hook_rot_k": per_head(
            entering(f"{ATTN}.attn", Argument(1, "key", kv_heads_split)), d_head, "kv_head"
        ),
        f"{BLOCK}.attn.hook_attn_scores": attention_scores(
            f"{BLOCK}.attn.hook_rot_q", f"{BLOCK}.attn.hook_rot_k", scale, explicit
        ),
        f"{BLOCK}.attn.hook_pattern": attention_pattern(f"{BLOCK}.attn.hook_attn_scores", explicit),
        f"{BLOCK}.attn.hook_z": per_head(z, d_head),
        f"{BLOCK}.attn.hook_result": head_results(
            f"{BLOCK}.attn.hook_z", "model.layers.{layer}.self_attn.o_proj.weight", explicit
        ),
        f"{BLOCK}.hook_attn_out": leaving(ATTN),
        f"{BLOCK}.hook_resid_mid": resid_mid,
        f"{BLOCK}.hook_mlp_in": resid_mid,
        f"{BLOCK}.ln2.hook_scale": norm_scale(resid_mid, eps),
        f"{BLOCK}.ln2.hook_normalized": normalized(resid_mid, eps),
        f"{BLOCK}.mlp.hook_pre": columns(gate_up, 0, d_mlp, "pos d_mlp"),
        f"{BLOCK}.mlp.hook_pre_linear": columns(gate_up, d_mlp, 2 * d_mlp, "pos d_mlp"),
        f"{BLOCK}.mlp.hook_post": post,
        f"{BLOCK}.hook_mlp_out": leaving(MLP),
        f"{BLOCK}.hook_resid_post": stream.post,
        "ln_final.hook_scale": norm_scale(resid_final, eps),
        "ln_final.hook_normalized": normalized(resid_final, eps),
        "unembed.hook_out": logits(stream.final_normed),
    }
    if window is not None:
        del specs[f"{BLOCK}.attn.hook_attn_scores"], specs[f"{BLOCK}.attn.hook_pattern"]
    return specs


def per_head_norms(config: PretrainedConfig) -> dict[str, Spec]:
    """``attn.hook_q_normed`` and ``attn.hook_k_normed`` (Qwen 3, Gemma 3, Apertus): the outputs of
    ``q_norm`` and ``k_norm``, which see ``[pos, heads, d_head]`` (under tensor parallelism, this
    rank's heads), heads first as TransformerLens's bridge gives them."""
    heads, kv_heads, _ = attention_dimensions(config)
    q_normed = leaving(f"{ATTN}.q_norm", shards=Shards(-2, (heads,)))
    k_normed = leaving(f"{ATTN}.k_norm", shards=Shards(-2, (kv_heads,)))
    return {
        f"{BLOCK}.attn.hook_q_normed": heads_first(q_normed),
        f"{BLOCK}.attn.hook_k_normed": heads_first(k_normed, "kv_head"),
    }


def explicit_attention(config: PretrainedConfig, scale: float | None = None) -> ExplicitAttention:
    """What computing a Llama-shaped layer's attention in the worker needs: its kernel and output
    projection, its heads and its scale (``d_head^-½`` unless given)."""
    heads, kv_heads, d_head = attention_dimensions(config)
    return ExplicitAttention(
        kernel=f"{ATTN}.attn",
        projection=f"{ATTN}.o_proj",
        heads=heads,
        kv_heads=kv_heads,
        d_head=d_head,
        scale=d_head**-0.5 if scale is None else scale,
    )


def windowed_name_error(name: str) -> str | None:
    """Why attention scores and patterns are missing (a config with a sliding window: see the
    module's docstring); None for any other name."""
    if not re.search(r"attn\.hook_(attn_scores|pattern)$", name):
        return None
    return (
        f"{name!r}: this model attends over a sliding window (config.sliding_window) and vlens "
        f"rebuilds attention scores and patterns with full causal attention only, so they are "
        f"not offered; attn.hook_rot_q, attn.hook_rot_k, attn.hook_v and attn.hook_z are"
    )


def tiny_config() -> PretrainedConfig:
    """Llama: tied embeddings, as in SmolLM2."""
    return LlamaConfig(**rotary_dims(), rms_norm_eps=1e-5, tie_word_embeddings=True)


WEIGHTS = WeightNames(
    normalization="RMS",
    eps="rms_norm_eps",
    W_E="model.embed_tokens.weight",
    W_Q=f"{ATTN}.q_proj.weight",
    W_K=f"{ATTN}.k_proj.weight",
    W_V=f"{ATTN}.v_proj.weight",
    W_O=f"{ATTN}.o_proj.weight",
    # Present only where the config asks for biases (attention_bias, mlp_bias).
    b_Q=f"{ATTN}.q_proj.bias",
    b_K=f"{ATTN}.k_proj.bias",
    b_V=f"{ATTN}.v_proj.bias",
    b_O=f"{ATTN}.o_proj.bias",
    W_in=f"{MLP}.up_proj.weight",
    b_in=f"{MLP}.up_proj.bias",
    W_gate=f"{MLP}.gate_proj.weight",
    W_out=f"{MLP}.down_proj.weight",
    b_out=f"{MLP}.down_proj.bias",
    ln1_w=f"{LAYER}.input_layernorm.weight",
    ln2_w=f"{LAYER}.post_attention_layernorm.weight",
    ln_final_w="model.norm.weight",
    W_U=("lm_head.weight", "model.embed_tokens.weight"),
)

MAPPING = ArchitectureMapping(
    architectures=("LlamaForCausalLM",),
    hook_specs=hook_specs,
    weights=WEIGHTS,
    tensor_parallel=True,
    compiled_graph=True,
    unavailable=windowed_name_error,
    tiny_configs={"llama": tiny_config},
    hf_recorder="hf_llama",
)
