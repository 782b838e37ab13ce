"""TransformerLens's per-head attention inputs, writable.

With ``use_split_qkv_input`` TransformerLens gives each head a copy of the block's input
(``hook_q_input``: ``[batch, pos, head, d_model]``; ``hook_k_input`` / ``hook_v_input``: one per
key-value head), and head ``h``'s query is ``ln1(copy_h) @ W_Q[h] + b_Q[h]``; with ``use_attn_in``
one set of copies (``hook_attn_in``) feeds queries, keys and values alike. vLLM forms no copies:
its fused projection reads one normalised input. So a hook function at one of these names runs
as a pair of hook functions vlens places itself (:func:`vlens.hooked.split_inputs.split`):

- :class:`KeepInput` at the block's ``hook_resid_pre``, after the user's own, keeps the block's
  input (as every later hook left it);
- :class:`RunOnCopies` at ``attn.hook_q`` (``hook_k``, ``hook_v``: what the copies feed) makes
  the copies, runs the user's functions on them under the split name, and where a copy changed
  recomputes that head's projection from the checkpoint's ``ln1`` and ``W_Q``; every value no
  edit touched stays vLLM's, bit for bit. For ``hook_attn_in`` the functions run once, at
  ``hook_q``, and ``hook_k`` / ``hook_v`` take the copies they left.

Before writing, the recomputation of the unedited copies is compared with vLLM's own value: an
architecture whose projection is not ``ln1`` then ``W`` (no norm before attention, a norm inside
the projection) is refused with a :class:`HookError` instead of edited wrongly.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from vlens.runtime.hooks.calls import Hook, call_hooks
from vlens.runtime.transfer.messages import HookError, HookFunction

#: How far (relative to the value's largest magnitude) the recomputed projection of the unedited
#: copies may differ from vLLM's: a summation order in fp32, the rounding of a 16-bit dtype.
AGREEMENT = {torch.float32: 1e-4, torch.float64: 1e-4}
AGREEMENT_16_BIT = 2e-2


#: each split name -> the projections its copies feed (TransformerLens's weight letters)
FEEDS = {"hook_q_input": "Q", "hook_k_input": "K", "hook_v_input": "V", "hook_attn_in": "QKV"}

_SPLIT = re.compile(rf"(blocks\.\d+)\.({'|'.join(FEEDS)})")


def split_of(name: str) -> tuple[str, tuple[tuple[str, str], ...]] | None:
    """Where a hook function on split input ``name`` runs: the block input's name, and each
    projection's weight letter and name in forward order; None for any other name."""
    found = _SPLIT.fullmatch(name)
    if found is None:
        return None
    block, split = found.groups()
    feeds = tuple((letter, f"{block}.attn.hook_{letter.lower()}") for letter in FEEDS[split])
    return f"{block}.hook_resid_pre", feeds


@dataclass(frozen=True)
class Norm:
    """A norm as the model applies it, in fp32: RMS (``centred=False``) or LayerNorm."""

    centred: bool
    eps: float
    weight: Float[Tensor, " d_model"]
    bias: Float[Tensor, " d_model"] | None = None
    offset: float = 0.0  # added to the weight (Gemma's ``1 + w``)

    def __call__(self, x: Float[Tensor, "... d_model"]) -> Float[Tensor, "... d_model"]:
        x = x.float()
        if self.centred:
            x = x - x.mean(-1, keepdim=True)
        normalized = x / (x.pow(2).mean(-1, keepdim=True) + self.eps).sqrt()
        out = normalized * (self.weight.to(x.device).float() + self.offset)
        return out if self.bias is None else out + self.bias.to(x.device).float()


@dataclass(frozen=True)
class Projection:
    """One of q, k, v per head: ``W`` ``[head, d_model, d_head]``, ``b`` ``[head, d_head]``."""

    W: Float[Tensor, "head d_model d_head"]
    b: Float[Tensor, "head d_head"] | None

    def __call__(
        self, normed: Float[Tensor, "batch pos head d_model"]
    ) -> Float[Tensor, "batch pos head d_head"]:
        out = torch.einsum("bphm,hmd->bphd", normed, self.W.to(normed.device).float())
        return out if self.b is None else out + self.b.to(normed.device).float()


@dataclass(eq=False)
class Fork:
    """What the two halves of one split name share within a call: the block input of the
    step, the copies its functions left (``hook_attn_in``), and the name's own ``hook.ctx``."""

    name: str
    heads: int
    functions: tuple[HookFunction, ...]
    norm: Norm | None  # None: no norm before attention
    block_input: Tensor | None = None
    copies: Tensor | None = None
    edited: bool = False
    ctx: dict[str, Any] = field(default_factory=dict)


@dataclass(eq=False)
class KeepInput:
    """At ``hook_resid_pre``: keeps the block's input for :class:`RunOnCopies`."""

    fork: Fork

    def __call__(self, value: Tensor, hook: Hook) -> None:
        # The hook's own copy (made outside inference mode), and this the last function at it.
        self.fork.block_input = value
        self.fork.copies = None


@dataclass(eq=False)
class RunOnCopies:
    """At the projection the copies feed (``attn.hook_q``, ``hook_k`` or ``hook_v``): the
    user's functions on the copies (once per step for a fork that feeds several), and the heads
    whose copy changed recomputed."""

    fork: Fork
    projection: Projection
    runs: bool  # the first of the fork's projections in the forward: it runs the functions

    def __call__(self, value: Tensor, hook: Hook) -> Tensor | None:
        fork = self.fork
        if self.runs:
            self._run(value, hook)
        elif fork.copies is None:
            raise HookError(
                f"{hook.name} ran before the projection that runs the hooks on {fork.name}: "
                f"this architecture orders its projections differently; hook {hook.name} itself"
            )
        if not fork.edited or fork.block_input is None:
            return None
        original = self._copies(fork.block_input, value.shape[2])
        edited = fork.copies if fork.copies.shape[2] == value.shape[2] else None
        if edited is None:
            raise HookError(
                f"{fork.name} holds {fork.copies.shape[2]} copies, but {hook.name} has "
                f"{value.shape[2]} heads (grouped keys and values): edit hook_q_input, "
                f"hook_k_input and hook_v_input instead"
            )
        changed = (edited != original).any(-1)  # [batch, pos, head]
        if not bool(changed.any()):
            return None
        self._check(self.projection(self._normed(original)), value, hook)
        recomputed = self.projection(self._normed(edited)).to(value.dtype)
        return torch.where(changed[..., None], recomputed, value)

    def _run(self, value: Tensor, hook: Hook) -> None:
        fork = self.fork
        fork.edited = False
        if fork.block_input is None:
            raise HookError(f"{fork.name}: the block's input was not kept this step")
        copies = self._copies(fork.block_input, fork.heads)
        fork.copies, fork.edited = call_hooks(
            fork.functions, copies, replace(hook, name=fork.name, ctx=fork.ctx)
        )

    def _normed(self, copies: Tensor) -> Tensor:
        return copies.float() if self.fork.norm is None else self.fork.norm(copies)

    def _copies(self, block_input: Tensor, heads: int) -> Tensor:
        with torch.inference_mode(False):
            return block_input[:, :, None, :].expand(-1, -1, heads, -1).clone()

    def _check(self, recomputed: Tensor, value: Tensor, hook: Hook) -> None:
        mask = hook.attention_mask
        theirs, ours = value[mask].float(), recomputed[mask]
        scale = theirs.abs().max().clamp_min(1e-6)
        tolerance = AGREEMENT.get(value.dtype, AGREEMENT_16_BIT)
        if (ours - theirs).abs().max() > tolerance * scale:
            raise HookError(
                f"a hook edited {self.fork.name}, but vlens cannot write that edit into this "
                f"architecture: its {hook.name} is not ln1 then the projection's weights "
                f"(recomputed from the checkpoint, the unedited copies give values "
                f"{float((ours - theirs).abs().max() / scale):.2e} of its scale away from "
                f"vLLM's); hook {hook.name} itself instead"
            )
