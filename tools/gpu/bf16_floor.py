"""``python tools/gpu/bf16_floor.py``: what bf16 arithmetic alone costs on the tiny checkpoints.

For each tiny model and each init standard deviation (``vlens.testing.tiny.tiny_model(arch,
init_std=...)``): HuggingFace's model cast to bf16 against itself in fp32 (eager, on the CPU), on
the parity prompts continued by ``DECODE_STEPS`` greedy tokens, for every name the HuggingFace
reference gives, the smallest cosine per token. That is the *floor* of ``parity/gpu.py``: a bf16
implementation cannot be expected to beat it by much.

A smaller init makes the model smoother, so the table also shows whether the model stays far from
degenerate: the greedy continuations (distinct tokens), how peaked the attention is (per layer, the
mean of ``1 − entropy / log(keys)`` over heads and query positions with at least 8 keys: 0 is
uniform, 1 one-hot) and the smallest per-position spread of the logits.

Runs on the CPU in about 15 seconds per init; it needs no vLLM engine. What it showed is in
docs/NOTES.md ("The bf16 floor").
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from vlens.parity.compare import PROMPTS
from vlens.parity.gpu import BF16_MIN_COS, auto_archs, hf_reference_in
from vlens.parity.reference import hf_reference, load_hf
from vlens.parity.run import DECODE_STEPS, rows_against

#: Attention rows with fewer keys say little about peakedness (one key is always one-hot).
MIN_KEYS = 8


def default_models() -> list[str]:
    """What the GPU bf16 parity runs: the tiny models CUDA runs as they are (``auto_archs``), and
    DeepSeek with the head dimensions CUDA's MLA kernels accept (``tiny_cuda.py``)."""
    import tiny_cuda  # this script's sibling: run as a script, its folder is on sys.path

    return [*auto_archs(), *tiny_cuda.NAMES]


def resolve(name: str, init_std: float) -> Path:
    """The tiny checkpoint ``name`` (``vlens.testing.tiny.ARCHS`` or ``tiny_cuda.py``'s ``NAMES``)
    drawn with ``init_std``."""
    import tiny_cuda  # this script's sibling: run as a script, its folder is on sys.path

    from vlens.testing.tiny import ARCHS, tiny_model

    if name in ARCHS:
        return tiny_model(name, init_std=init_std)
    if name in tiny_cuda.NAMES:
        return tiny_cuda.build(name, init_std=init_std)
    raise SystemExit(f"{name!r} is none of {ARCHS + tuple(tiny_cuda.NAMES)}")


@dataclass(frozen=True)
class Health:
    """Signs that a checkpoint is not degenerate, from its fp32 HuggingFace forward."""

    continuations: list[list[int]]  # per prompt: its greedy tokens
    distinct_tokens: int  # over every continuation
    peakedness: list[float]  # per layer: mean 1 − entropy/log(keys), 0 uniform, 1 one-hot
    max_weight_ratio: list[float]  # per layer: mean (largest attention weight · keys)
    min_logit_std: float  # smallest std of the logits over the vocabulary, over positions


@torch.no_grad()
def greedy(path: Path, prompts: list[list[int]]) -> tuple[list[list[int]], Health]:
    """The prompts continued by ``DECODE_STEPS`` greedy tokens (fp32), and the model's health."""
    model = load_hf(path)
    sequences = []
    for prompt in prompts:
        tokens = list(prompt)
        for _ in range(DECODE_STEPS):
            tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
        sequences.append(tokens)
    layers = model.config.num_hidden_layers
    peaked: list[list[float]] = [[] for _ in range(layers)]
    ratio: list[list[float]] = [[] for _ in range(layers)]
    logit_std = math.inf
    for tokens in sequences:
        output = model(torch.tensor([tokens]), output_attentions=True)
        logit_std = min(logit_std, float(output.logits[0].std(dim=-1).min()))
        for layer, pattern in enumerate(output.attentions):
            pattern = pattern[0].double()  # [head, query, key]
            for query in range(MIN_KEYS - 1, pattern.shape[1]):
                row = pattern[:, query, : query + 1]
                entropy = -(row * row.clamp_min(1e-30).log()).sum(-1)
                peaked[layer] += (1 - entropy / math.log(query + 1)).tolist()
                ratio[layer] += (row.max(-1).values * (query + 1)).tolist()
    continuations = [tokens[len(prompt) :] for tokens, prompt in zip(sequences, prompts)]
    health = Health(
        continuations=continuations,
        distinct_tokens=len({t for c in continuations for t in c}),
        peakedness=[sum(v) / len(v) for v in peaked],
        max_weight_ratio=[sum(v) / len(v) for v in ratio],
        min_logit_std=logit_std,
    )
    return sequences, health


def measure(name: str, init_std: float) -> dict[str, Any]:
    """The floor per name (min cosine, HuggingFace bf16 against fp32) and the model's health."""
    from transformers import AutoTokenizer

    path = resolve(name, init_std)
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = [tokenizer(text)["input_ids"] for text in PROMPTS]
    sequences, health = greedy(path, prompts)
    reference = hf_reference(path, sequences)
    low = hf_reference_in(path, sequences, torch.bfloat16)
    rows = rows_against("HF-bf16", "prefill+decode", low, reference)
    return {
        "model": name,
        "init_std": init_std,
        "floor": {row.name: row.min_cos for row in rows},
        "health": asdict(health),
    }


def summary(results: list[dict[str, Any]]) -> str:
    """A Markdown table, one row per model and init."""
    lines = [
        "| model | init std | names | min cosine (name) | names < 0.9999 | names < 0.99995 | "
        "distinct greedy tokens | attention peakedness per layer | min logit std |",
        "| --- " * 9 + "|",
    ]
    for result in results:
        floor, health = result["floor"], result["health"]
        name = min(floor, key=floor.__getitem__)
        peaked = ", ".join(f"{p:.2f}" for p in health["peakedness"])
        lines.append(
            f"| {result['model']} | {result['init_std']:g} | {len(floor)} | "
            f"{floor[name]:.7f} (`{name}`) | {sum(c < BF16_MIN_COS for c in floor.values())} | "
            f"{sum(c < 0.99995 for c in floor.values())} | {health['distinct_tokens']} | "
            f"{peaked} | {health['min_logit_std']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from vlens.mappings._tiny import INIT_STD

    parser = argparse.ArgumentParser(prog="python tools/gpu/bf16_floor.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="*", help="default: default_models()")
    parser.add_argument("--init-std", nargs="+", type=float, default=[INIT_STD, 0.05, 0.03, 0.02])
    parser.add_argument("--json", type=Path, help="also write every name's floor here")
    parser.add_argument("--verbose", action="store_true",
                        help="also print each model's names under 0.99995 and its continuations")
    args = parser.parse_args(argv)
    args.models = args.models or default_models()
    results = []
    for init_std in args.init_std:
        for name in args.models:
            result = measure(name, init_std)
            results.append(result)
            if args.verbose:
                low = {n: f"{c:.7f}" for n, c in result["floor"].items() if c < 0.99995}
                print(f"{name} std={init_std:g}: {low or 'every name >= 0.99995'}; "
                      f"continuations {result['health']['continuations']}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    print(summary(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
