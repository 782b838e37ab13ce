"""Pieces of a block's canonical names that several HuggingFace recorders (``hf_*.py``) build
alike: the per-head views and copies around the attention, and a dense MLP's names."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from vlens.parity.reference import Recorder, Values


def per_head(x: Tensor, d_head: int) -> Tensor:
    """``[b, pos, H·d_head]`` as ``[b, pos, H, d_head]`` (unchanged if split per head already)."""
    return x.reshape(*x.shape[:2], -1, d_head)


def block_input(block: str, x: Tensor, heads: int, kv_heads: int) -> Values:
    """``hook_resid_pre`` (the block input ``x``) and its copies per head, as TransformerLens gives
    the attention's inputs: once per query head (``hook_attn_in``, ``hook_q_input``), once per
    key/value head (``hook_k_input``, ``hook_v_input``)."""
    counts = {"attn_in": heads, "q_input": heads, "k_input": kv_heads, "v_input": kv_heads}
    out = {f"{block}.hook_resid_pre": x}
    for name, n in counts.items():
        out[f"{block}.hook_{name}"] = x[:, :, None].expand(-1, -1, n, -1)
    return out


def record_qkv(recorder: Recorder, attn: nn.Module, i: int) -> None:
    """Hooks keeping layer ``i``'s q, k and v projections' outputs (``q{i}``, ``k{i}``, ``v{i}``;
    ``qkv{i}`` for one fused ``qkv_proj``) and, where the attention has them, its q and k norms'
    (``q_norm{i}``, ``k_norm{i}``)."""
    if hasattr(attn, "qkv_proj"):
        recorder.output(attn.qkv_proj, f"qkv{i}")
    else:
        for part in ("q", "k", "v"):
            recorder.output(getattr(attn, f"{part}_proj"), f"{part}{i}")
    for part in ("q_norm", "k_norm"):
        if hasattr(attn, part):
            recorder.output(getattr(attn, part), f"{part}{i}")


def qkv_heads(attn: str, d_head: int, q: Tensor, k: Tensor, v: Tensor) -> Values:
    """``hook_q``, ``hook_k`` and ``hook_v`` of the attention ``attn``: its q, k and v per head."""
    return {f"{attn}.hook_{name}": per_head(x, d_head) for name, x in zip("qkv", (q, k, v))}


def rotated_qk(
    attn: str, apply: Callable[..., tuple[Tensor, Tensor]], q: Tensor, k: Tensor, *rope: Tensor
) -> Values:
    """``hook_rot_q`` and ``hook_rot_k``: q and k ``[b, pos, H, d_head]`` through the model's
    rotary function ``apply(q, k, *rope)``, which works heads first (``[b, H, pos, d_head]``, as
    HuggingFace's ``apply_rotary_pos_emb`` does), given back position first."""
    rot_q, rot_k = apply(q.transpose(1, 2), k.transpose(1, 2), *rope)
    return {f"{attn}.hook_rot_{x}": rot.transpose(1, 2) for x, rot in (("q", rot_q), ("k", rot_k))}


def z_and_result(attn: str, z: Tensor, w_o: Tensor, heads: int) -> Values:
    """``hook_z`` (the output projection's input ``[b, pos, H·d_head]``, per head) and
    ``hook_result``, each head's term of the projection's output: HuggingFace sums the heads in
    one matmul, so the terms are rebuilt as each head's z times its ``d_head`` columns of ``w_o``
    (the weight as a Linear holds it, ``[d_model, H·d_head]``)."""
    w_o = w_o.reshape(w_o.shape[0], heads, -1)  # [d_model, H, d_head]
    z = per_head(z, w_o.shape[-1])
    return {f"{attn}.hook_z": z, f"{attn}.hook_result": torch.einsum("bphd,mhd->bphm", z, w_o)}


def record_dense_mlp(
    recorder: Recorder,
    mlp: nn.Module,
    i: int,
    gate: str | None = "gate_proj",
    up: str = "up_proj",
    down: str = "down_proj",
) -> None:
    """Hooks keeping what :func:`dense_mlp_values` reads of layer ``i``'s MLP, whose projections
    are the submodules ``gate`` (None: an ungated MLP), ``up`` and ``down``: the gate's and up's
    outputs and the input of down (the activation, times up where gated)."""
    if gate is not None:
        recorder.output(mlp.get_submodule(gate), f"gate{i}")
    recorder.output(mlp.get_submodule(up), f"up{i}")
    recorder.inputs(mlp.get_submodule(down), f"post_act{i}", "input")


def dense_mlp_values(mlp: str, seen: dict[str, Any], i: int) -> Values:
    """``hook_pre`` (the gate, or an ungated MLP's only input projection), ``hook_pre_linear``
    (a gated MLP's up) and ``hook_post`` (the down projection's input) of the MLP ``mlp`` of layer
    ``i``, from what :func:`record_dense_mlp` keeps. A fused ``[gate | up]`` projection's output,
    kept under ``gate_up{i}`` in its place, is split in halves as HuggingFace splits it."""
    if f"gate_up{i}" in seen:
        gate, up = seen[f"gate_up{i}"].chunk(2, dim=-1)
    else:
        gate, up = seen.get(f"gate{i}"), seen[f"up{i}"]
    if gate is None:
        out = {f"{mlp}.hook_pre": up}
    else:
        out = {f"{mlp}.hook_pre": gate, f"{mlp}.hook_pre_linear": up}
    out[f"{mlp}.hook_post"] = seen[f"post_act{i}"]
    return out
