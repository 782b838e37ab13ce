"""HuggingFace reference for DeepSeek-V2 and -V3 (``model.model.layers[i]``: multi-head latent
attention, a dense MLP below ``first_k_dense_replace``, a mixture of experts above)."""

from __future__ import annotations

from collections.abc import Callable
from importlib import import_module
from typing import Any

import torch
from einops import rearrange
from torch import Tensor, nn

from vlens.parity import common
from vlens.parity.reference import Recorder, Values, after_blocks, rms_parts


def record_outputs(recorder: Recorder, module: nn.Module, key: str) -> None:
    """Keep a module's whole result (a tuple stays a tuple)."""

    def hook(_m: nn.Module, _args: tuple, output: Any) -> None:
        recorder.seen[key] = output

    recorder.handles.append(module.register_forward_hook(hook))


def interleaved(x: Tensor) -> Tensor:
    """``[even channels | odd channels]`` → the interleaved pairs ``(x0, x1), (x2, x3)...``."""
    return rearrange(x, "... (two half) -> ... (half two)", two=2)


def record(
    model: nn.Module, recorder: Recorder
) -> Callable[[Tensor, tuple[Tensor, ...]], Values]:
    """Hooks for DeepSeek-V2/V3; returns the function that turns one forward's recordings (and its
    logits and attention weights) into canonical names.

    Read off HuggingFace modules: embeddings, block input and output, ``q_a_layernorm`` (q
    latent), ``q_b_proj``/``q_proj`` (q), ``kv_a_proj_with_mqa`` (its last ``d_rope`` columns:
    k_pe), ``kv_a_layernorm`` (kv latent), ``kv_b_proj`` (k_nope and v), ``o_proj``'s input (z),
    the attention and MLP outputs, the dense MLP's projections, the router (``gate``: logits,
    weights, indices), ``shared_experts`` and ``experts`` (the routed sum), and the pattern
    (HuggingFace's attention weights).

    Rebuilt from HuggingFace tensors by the model's own formula, where HuggingFace has no module:
    the rotated q and k rope parts (the modeling file's own rotary function on HuggingFace's q and
    k_pe with the position embeddings HuggingFace passes to the attention; V3's function returns
    the rotated pairs de-interleaved, ``[even | odd]``, and they are put back in the checkpoint's
    interleaved order, in which vLLM keeps them), per-head ``k`` / ``rot_k`` (``kv_b_proj``'s
    k_nope beside k_pe, rotated or not), the attention scores (``rot_q·rot_k`` times the attention
    module's own ``scaling``, causally masked), ``hook_result`` (z per head times ``o_proj``'s
    weight), ``ln*`` scale and normalized (from the norm's input), and the router's weights and
    indices put in vlens's order: best selection score first (sigmoid score plus
    ``e_score_correction_bias`` for V3, softmax score for V2), as HuggingFace's ``topk`` leaves
    them unsorted.
    """
    modeling = import_module(type(model).__module__)
    config = model.config
    eps, heads = config.rms_norm_eps, config.num_attention_heads
    d_nope = config.qk_nope_head_dim
    kv_rank = config.kv_lora_rank
    inner = model.model
    recorder.output(inner.embed_tokens, "embed")
    for i, layer in enumerate(inner.layers):
        attn, mlp = layer.self_attn, layer.mlp
        recorder.inputs(layer, f"pre{i}", "hidden_states")
        recorder.inputs(attn, f"rope{i}", "position_embeddings")
        if attn.q_lora_rank is None:
            recorder.output(attn.q_proj, f"q{i}")
        else:
            recorder.output(attn.q_a_layernorm, f"q_latent{i}")
            recorder.output(attn.q_b_proj, f"q{i}")
        recorder.output(attn.kv_a_proj_with_mqa, f"kv_a{i}")
        recorder.output(attn.kv_a_layernorm, f"kv_latent{i}")
        recorder.output(attn.kv_b_proj, f"kv{i}")
        recorder.inputs(attn.o_proj, f"z{i}", "input")
        recorder.output(attn, f"attn{i}")
        recorder.inputs(layer.post_attention_layernorm, f"mid{i}", "hidden_states")
        if hasattr(mlp, "gate"):
            record_outputs(recorder, mlp.gate, f"router{i}")
            recorder.output(mlp.shared_experts, f"shared{i}")
            recorder.output(mlp.experts, f"routed{i}")
        else:
            common.record_dense_mlp(recorder, mlp, i)
        recorder.output(mlp, f"mlp{i}")
        recorder.output(layer, f"post{i}")
    recorder.inputs(inner.norm, "final", "hidden_states")

    def rotate(q_pe: Tensor, k_pe: Tensor, rope: Any) -> tuple[Tensor, Tensor]:
        """``q_pe [b, p, H, d]`` and ``k_pe [b, p, d]`` rotated as the modeling file does."""
        q, k = q_pe.transpose(1, 2), k_pe[:, None]
        if config.model_type == "deepseek_v2":
            q, k = modeling.apply_rotary_emb(q, k, rope)
        elif getattr(config, "rope_interleave", False):
            q, k = (interleaved(x) for x in modeling.apply_rotary_pos_emb_interleave(q, k, *rope))
        else:
            raise NotImplementedError("vLLM rotates DeepSeek's rope channels in interleaved pairs")
        return q.transpose(1, 2), k[:, 0]

    def values(logits: Tensor, attentions: tuple[Tensor, ...]) -> Values:
        seen = recorder.seen
        out = {"hook_embed": seen["embed"]}
        for i, layer in enumerate(inner.layers):
            block, attn = f"blocks.{i}", layer.self_attn
            pre, mid = seen[f"pre{i}"], seen[f"mid{i}"]
            out[f"{block}.hook_resid_pre"] = pre
            out[f"{block}.ln1.hook_scale"], out[f"{block}.ln1.hook_normalized"] = rms_parts(
                pre, eps
            )
            if f"q_latent{i}" in seen:
                out[f"{block}.attn.hook_q_latent"] = seen[f"q_latent{i}"]
            q = rearrange(seen[f"q{i}"], "b p (h d) -> b p h d", h=heads)
            k_pe = seen[f"kv_a{i}"][..., kv_rank:]
            rot_q_pe, rot_k_pe = rotate(q[..., d_nope:], k_pe, seen[f"rope{i}"])
            rot_q = torch.cat([q[..., :d_nope], rot_q_pe], dim=-1)
            kv = seen[f"kv{i}"].reshape(*q.shape[:3], -1)  # HF runs kv_b_proj on [b, 1, p, rank]
            k_nope, v = kv[..., :d_nope], kv[..., d_nope:]
            k = torch.cat([k_nope, k_pe[:, :, None].expand(-1, -1, heads, -1)], dim=-1)
            rot_k = torch.cat([k_nope, rot_k_pe[:, :, None].expand(-1, -1, heads, -1)], dim=-1)
            scores = torch.einsum("bqhd,bkhd->bhqk", rot_q, rot_k) * attn.scaling
            n = scores.shape[-1]
            future = torch.ones(n, n, dtype=torch.bool).triu(1)
            out[f"{block}.attn.hook_q"] = q
            out[f"{block}.attn.hook_kv_latent"] = seen[f"kv_latent{i}"]
            out[f"{block}.attn.hook_k_pe"] = k_pe
            out[f"{block}.attn.hook_rot_q"] = rot_q
            out[f"{block}.attn.hook_rot_k_pe"] = rot_k_pe
            out[f"{block}.attn.hook_k"] = k
            out[f"{block}.attn.hook_rot_k"] = rot_k
            out[f"{block}.attn.hook_v"] = v
            out[f"{block}.attn.hook_attn_scores"] = scores.masked_fill(future, float("-inf"))
            out[f"{block}.attn.hook_pattern"] = attentions[i]
            out |= common.z_and_result(f"{block}.attn", seen[f"z{i}"], attn.o_proj.weight, heads)
            out[f"{block}.hook_attn_out"] = seen[f"attn{i}"]
            out[f"{block}.hook_resid_mid"] = mid
            out[f"{block}.hook_mlp_in"] = mid
            out[f"{block}.ln2.hook_scale"], out[f"{block}.ln2.hook_normalized"] = rms_parts(
                mid, eps
            )
            if f"router{i}" in seen:
                out.update(routing(block, layer.mlp.gate, seen[f"router{i}"], pre.shape[:2]))
                out[f"{block}.mlp.hook_shared_out"] = seen[f"shared{i}"]
                out[f"{block}.mlp.hook_routed_out"] = seen[f"routed{i}"].reshape(mid.shape)
            else:
                out |= common.dense_mlp_values(f"{block}.mlp", seen, i)
            out[f"{block}.hook_mlp_out"] = seen[f"mlp{i}"]
            out[f"{block}.hook_resid_post"] = seen[f"post{i}"]
        return after_blocks(out, rms_parts(seen["final"], eps), logits)

    return values


def routing(
    block: str, gate: nn.Module, recorded: tuple[Tensor, Tensor, Tensor], batch_pos: torch.Size
) -> Values:
    """The router's logits, weights and indices ``[b, p, ...]``, best selection score first."""
    router_logits, weights, indices = (x.reshape(*batch_pos, -1) for x in recorded)
    bias = getattr(gate, "e_score_correction_bias", None)
    if bias is None:
        selection = router_logits.softmax(dim=-1)
    else:
        selection = router_logits.sigmoid() + bias
    order = selection.gather(-1, indices).argsort(dim=-1, descending=True)
    return {
        f"{block}.mlp.hook_router_logits": router_logits,
        f"{block}.mlp.hook_expert_weights": weights.gather(-1, order),
        f"{block}.mlp.hook_expert_indices": indices.gather(-1, order),
    }
