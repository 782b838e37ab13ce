"""A per-head norm's value read from either layout vLLM calls it with: ``[pos, heads, d_head]``
(0.27 on) or ``[pos·heads, d_head]`` rows (0.26's Apertus), edits reaching the model's tensor in
both (:class:`vlens.runtime.vocabulary.readers.HeadsInRows`)."""

from __future__ import annotations

import torch
from torch import nn

from vlens.mappings import apertus
from vlens.names.mapping import attention_dimensions
from vlens.runtime.sites.torch_hooks import NarrowedCall
from vlens.runtime.steps.layout import RequestRows

CONFIG = apertus.tiny_config()
HEADS, KV_HEADS, D_HEAD = attention_dimensions(CONFIG)
TOKENS = 7
REQUEST = RequestRows("b", 2, 5, 0, 3)  # the second of two requests: tokens 2..4 of the step


def call_of(result: torch.Tensor) -> NarrowedCall:
    return NarrowedCall(nn.Identity(), REQUEST, (), {}, result)


def test_both_layouts_read_the_same_rows_and_take_the_same_edits():
    norms = apertus.per_head_norms(CONFIG)
    for name, heads in [("blocks.{layer}.attn.hook_q_normed", HEADS),
                        ("blocks.{layer}.attn.hook_k_normed", KV_HEADS)]:
        read = norms[name].read
        per_token = torch.randn(TOKENS, heads, D_HEAD)
        rows = per_token.reshape(TOKENS * heads, D_HEAD).clone()
        expected = per_token[REQUEST.start : REQUEST.stop]
        assert torch.equal(read(call_of(per_token)), expected), name
        assert torch.equal(read(call_of(rows)), expected), name

        read.write(call_of(rows), torch.zeros_like(expected))
        edited = rows.view(TOKENS, heads, D_HEAD)
        assert not edited[REQUEST.start : REQUEST.stop].any(), name
        assert torch.equal(edited[: REQUEST.start], per_token[: REQUEST.start]), name
        assert torch.equal(edited[REQUEST.stop :], per_token[REQUEST.stop :]), name
