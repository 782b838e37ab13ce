"""Running the parity check: vlens's cache for a mixed batch against each prompt run alone in
HuggingFace and in TransformerLens, on the prompts (prefill) and on prompts continued by greedy
decoding (every decode step's rows against one reference forward over the whole sequence)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from vlens.hooked.model import HookedVLLM
from vlens.parity.compare import PROMPTS, Row, compare
from vlens.parity.reference import Values, hf_reference, transformer_lens_reference

DECODE_STEPS = 6


def rows_against(reference: str, mode: str, ours: list[Values], theirs: list[Values]) -> list[Row]:
    names = [name for name in ours[0] if name in theirs[0]]
    return [
        compare(name, reference, mode, [v[name] for v in ours], [t[name] for t in theirs])
        for name in names
    ]


def skips_bridge(path: str | Path) -> bool:
    """Whether the checkpoint's mapping says TransformerLens's bridge is no reference for it
    (``ArchitectureMapping.no_bridge_reference``), even where the bridge boots."""
    from transformers import AutoConfig

    from vlens.mappings import mapping_for

    return mapping_for(AutoConfig.from_pretrained(path)).no_bridge_reference is not None


def run_parity(
    model: HookedVLLM, path: str | Path, texts: Sequence[str] = PROMPTS
) -> tuple[list[Row], list[str]]:
    """Rows against HuggingFace and TransformerLens, prefill and decode, and the names that no
    reference covered."""
    prompts = model.token_lists(list(texts))
    with_bridge = not skips_bridge(path)
    rows: list[Row] = []
    for mode, new_tokens in (("prefill", 0), ("decode", DECODE_STEPS)):
        _, cache = model.run_with_cache(prompts, max_new_tokens=new_tokens)
        sequences = [cache.tokens[i, : int(n)].tolist() for i, n in enumerate(cache.lengths)]
        ours = [{name: cache.unpadded(name, i) for name in cache.keys()} for i in range(len(prompts))]
        reference = hf_reference(path, sequences)
        for values, prompt in zip(reference, prompts):
            # The sampler sees the logits of each prompt's last token, then of each new one.
            values["sampler.hook_logits"] = values["unembed.hook_out"][len(prompt) - 1 :]
            values["sampler.hook_tokens"] = values["sampler.hook_logits"].argmax(-1)  # greedy
        rows += rows_against("HuggingFace", mode, ours, reference)
        tl = transformer_lens_reference(path, sequences, list(ours[0])) if with_bridge else None
        if tl is not None:
            rows += rows_against("TransformerLens", mode, ours, tl)
    covered = {row.name for row in rows}
    return rows, [name for name in model.hook_names if name not in covered]
