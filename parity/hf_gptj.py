"""HuggingFace reference for GPT-J (``model.transformer.h[i]``: one LayerNorm before attention
and MLP in parallel, interleaved rotary on the first ``rotary_dim`` features of each head).

HuggingFace rotates q and k inside the attention's forward: ``hook_rot_q``/``hook_rot_k`` are
its ``q_proj``/``k_proj`` outputs rotated by its own ``apply_rotary_pos_emb`` with the
attention's own sinusoid table (``embed_positions``), the features past ``rotary_dim`` passed
through as HuggingFace concatenates them; ``hook_attn_scores`` are those rotated q and k times
``1/scale_attn`` (HuggingFace's own scale, ``sqrt(d_head)``), the future masked with -inf.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn
from transformers.models.gptj.modeling_gptj import apply_rotary_pos_emb

from vlens.parity import common
from vlens.parity.hf_gpt2 import layer_norm_parts
from vlens.parity.hf_moe import causal_scores
from vlens.parity.reference import Recorder, Values, after_blocks


def rotated(attn: nn.Module, x: Tensor) -> Tensor:
    """``x`` ``[b, pos, H, d_head]`` rotated as GPT-J's attention rotates its q and k."""
    width = attn.rotary_dim or x.shape[-1]
    positions = torch.arange(x.shape[1])
    sin, cos = attn.embed_positions[positions][None].chunk(2, dim=-1)
    rot = apply_rotary_pos_emb(x[..., :width], sin, cos)
    return torch.cat([rot, x[..., width:]], dim=-1)


def record(
    model: nn.Module, recorder: Recorder
) -> Callable[[Tensor, tuple[Tensor, ...]], Values]:
    """Hooks for GPT-J; returns the function that turns one forward's recordings (and its logits)
    into canonical names (see the module's docstring; ``hook_result`` is HuggingFace's z times
    ``out_proj``'s weight per head; the pattern is HuggingFace's own attention weights)."""
    config = model.config
    eps = config.layer_norm_epsilon
    heads = config.n_head
    d_head = config.n_embd // heads
    inner = model.transformer
    recorder.output(inner.wte, "embed")
    for i, block in enumerate(inner.h):
        recorder.inputs(block, f"pre{i}", "hidden_states")
        common.record_qkv(recorder, block.attn, i)
        recorder.inputs(block.attn.out_proj, f"z{i}", "input")
        recorder.output(block.attn, f"attn{i}")
        common.record_dense_mlp(recorder, block.mlp, i, gate=None, up="fc_in", down="fc_out")
        recorder.output(block.mlp, f"mlp{i}")
        recorder.output(block, f"post{i}")
    recorder.inputs(inner.ln_f, "final", "input")

    def values(logits: Tensor, attentions: tuple[Tensor, ...]) -> Values:
        seen = recorder.seen
        out = {"hook_embed": seen["embed"]}
        for i, block in enumerate(inner.h):
            name, attn = f"blocks.{i}", f"blocks.{i}.attn"
            pre = seen[f"pre{i}"]
            out |= common.block_input(name, pre, heads, heads)
            out[f"{name}.ln1.hook_scale"], out[f"{name}.ln1.hook_normalized"] = layer_norm_parts(
                pre, eps
            )
            out |= common.qkv_heads(attn, d_head, *(seen[f"{p}{i}"] for p in "qkv"))
            out[f"{attn}.hook_rot_q"] = rotated(block.attn, out[f"{attn}.hook_q"])
            out[f"{attn}.hook_rot_k"] = rotated(block.attn, out[f"{attn}.hook_k"])
            rot_q, rot_k = (out[f"{attn}.hook_rot_{x}"].transpose(1, 2) for x in "qk")
            scale = 1 / float(block.attn.scale_attn)
            out[f"{attn}.hook_attn_scores"] = causal_scores(rot_q, rot_k, scale)
            out[f"{attn}.hook_pattern"] = attentions[i]
            out |= common.z_and_result(attn, seen[f"z{i}"], block.attn.out_proj.weight, heads)
            out[f"{name}.hook_attn_out"] = seen[f"attn{i}"]
            out |= common.dense_mlp_values(f"{name}.mlp", seen, i)
            out[f"{name}.hook_mlp_out"] = seen[f"mlp{i}"]
            out[f"{name}.hook_resid_post"] = seen[f"post{i}"]
        return after_blocks(out, layer_norm_parts(seen["final"], eps), logits)

    return values
