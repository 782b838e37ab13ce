"""Comparing vlens's cache with reference values, and the parity table.

Errors are taken per token (per position, over the value's other axes): activations at position 0
of a real model reach 10⁴, so a relative error per element, or one absolute bound, would say
little. ``max_rel`` is ``max ‖vlens − ref‖ / ‖ref‖`` over tokens; ``min_cos`` the smallest cosine.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

#: fp32 on CPU: vLLM's kernels against HuggingFace's eager fp32 agree to ~1e-6; 1e-4 leaves room
#: for accumulation-order differences across a few layers, and is far below any real mistake
#: (a wrong position, head or sign gives errors of order 1).
FP32_MAX_REL = 1e-4

PROMPTS = (
    "The quick brown fox jumps over the lazy dog.",
    "Hello",
    "In 1905, a patent clerk published four papers that changed physics forever, and",
    "vLLM batches requests of different lengths together.",
)


@dataclass(frozen=True)
class Row:
    name: str
    reference: str
    mode: str
    max_abs: float
    max_rel: float
    min_cos: float

    @property
    def layer(self) -> str:
        found = re.match(r"blocks\.(\d+)\.", self.name)
        return found.group(1) if found else "-"

    def within(self, max_rel: float) -> bool:
        return self.max_rel <= max_rel


def per_token(value: Tensor, name: str) -> Tensor:
    """``[pos, ...]`` → ``[pos, features]`` in float64, masked scores (-inf) as zero.

    Attention scores and patterns are ``[head, query_pos, key_pos]``: their tokens are the query
    positions, so the head axis is moved behind them first."""
    if name.endswith(("hook_attn_scores", "hook_pattern", "_normed")):
        value = value.transpose(0, 1)
    value = value.double()
    return value.masked_fill(value.isneginf(), 0.0).reshape(value.shape[0], -1)


def compare(
    name: str, reference: str, mode: str, ours: Sequence[Tensor], theirs: Sequence[Tensor]
) -> Row:
    """Errors of ``ours`` against ``theirs`` over every prompt (each ``[pos, ...]``)."""
    max_abs, max_rel, min_cos = 0.0, 0.0, 1.0
    for mine, ref in zip(ours, theirs, strict=True):
        if mine.shape != ref.shape:
            raise AssertionError(f"{name}: shape {tuple(mine.shape)} vs {reference} {tuple(ref.shape)}")
        if not torch.equal(mine.isneginf(), ref.isneginf()):
            raise AssertionError(f"{name}: masked positions differ from {reference}")
        a, b = per_token(mine, name), per_token(ref, name)
        diff = (a - b).norm(dim=-1)
        max_abs = max(max_abs, (a - b).abs().max().item())
        max_rel = max(max_rel, (diff / b.norm(dim=-1).clamp_min(1e-30)).max().item())
        cos = torch.nn.functional.cosine_similarity(a, b, dim=-1, eps=1e-30)
        min_cos = min(min_cos, cos.min().item())
    return Row(name, reference, mode, max_abs, max_rel, min_cos)


def table(title: str, rows: Sequence[Row], max_rel: float) -> str:
    """A Markdown table, one row per name and reference, flagging rows over ``max_rel``."""
    lines = [
        f"### {title}",
        "",
        "| name | layer | mode | reference | max abs err | max rel err | min cosine | ok |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        ok = "yes" if row.within(max_rel) else "**NO**"
        lines.append(
            f"| `{row.name}` | {row.layer} | {row.mode} | {row.reference} | {row.max_abs:.2e} | "
            f"{row.max_rel:.2e} | {row.min_cos:.8f} | {ok} |"
        )
    return "\n".join(lines) + "\n"
