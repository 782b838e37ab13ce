"""Running the parity check: vlens's cache for a mixed batch against each prompt run alone in
HuggingFace and in TransformerLens."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from vlens.hooked import HookedVLLM
from vlens.parity.compare import PROMPTS, Row, compare
from vlens.parity.reference import Values, hf_reference, transformer_lens_reference


def vlens_values(model: HookedVLLM, prompts: list[list[int]]) -> list[Values]:
    """Every name of ``model`` for ``prompts``, submitted together as one batch."""
    _, cache = model.run_with_cache(prompts)
    return [
        {name: cache[name][index, : len(prompt)] for name in cache.keys()}
        for index, prompt in enumerate(prompts)
    ]


def rows_against(reference: str, ours: list[Values], theirs: list[Values]) -> list[Row]:
    names = [name for name in ours[0] if name in theirs[0]]
    return [
        compare(name, reference, [v[name] for v in ours], [t[name] for t in theirs])
        for name in names
    ]


def run_parity(
    model: HookedVLLM, path: str | Path, texts: Sequence[str] = PROMPTS
) -> tuple[list[Row], list[str]]:
    """Rows against HuggingFace and TransformerLens, and the names no reference covered."""
    prompts = model.token_lists(list(texts))
    ours = vlens_values(model, prompts)
    rows = rows_against("HuggingFace", ours, hf_reference(path, prompts))
    rows += rows_against(
        "TransformerLens", ours, transformer_lens_reference(path, prompts, list(ours[0]))
    )
    covered = {row.name for row in rows}
    return rows, [name for name in ours[0] if name not in covered]
