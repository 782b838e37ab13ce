"""Attribution patching against activation patching, per attention head, on indirect object
identification with SmolLM2-135M: the same cells, the same metric, both from one ``HookedVLLM``.

    python docs/examples/ioi_patching.py [--json results.json]

Activation patching (``patching.get_act_patch_attn_head_out_all_pos``) runs one request per
head per prompt on vLLM; attribution patching (``patching.attribution(..., "z")``) estimates
every head from one forward and one backward on the gradient twin. Prints both tables' agreement
(correlation, the heads each ranks highest) and the time each took.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from jaxtyping import Float
from torch import Tensor

from vlens import HookedVLLM, patching
from vlens.testing.embedded import smollm2_path

#: (template, indirect object, subject): every name one token, every prompt one length.
PROMPTS = [
    ("When{a} and{b} went to the shops,{b} gave the bag to", " Mary", " John"),
    ("When{a} and{b} went to the park,{b} gave the ball to", " Tom", " James"),
    ("When{a} and{b} went to the station,{b} gave the ticket to", " Alice", " Bob"),
    ("When{a} and{b} went to the market,{b} gave the apple to", " Sarah", " Paul"),
    ("When{a} and{b} went to the school,{b} gave the book to", " Anna", " Martin"),
    ("When{a} and{b} went to the office,{b} gave the pen to", " Amy", " Dan"),
]
TOP = 10


def prompts(model: HookedVLLM) -> tuple[Tensor, Tensor, Tensor]:
    """Clean prompts (``a``: the indirect object, ``b``: the subject), corrupted ones with the
    two names swapped in the repeated position (the answer flips), and ``[prompt, 2]`` token
    ids of (clean answer, corrupted answer)."""
    clean = [t.format(a=io, b=s) for t, io, s in PROMPTS]
    corrupted = [t.format(a=s, b=io) for t, io, s in PROMPTS]
    answers = torch.tensor([[model.to_single_token(io), model.to_single_token(s)]
                            for _, io, s in PROMPTS])
    clean_tokens, corrupted_tokens = model.to_tokens(clean), model.to_tokens(corrupted)
    if clean_tokens.shape != corrupted_tokens.shape:
        raise ValueError("clean and corrupted prompts must tokenize to one length")
    return clean_tokens, corrupted_tokens, answers


def logit_diff(logits: Float[Tensor, "batch pos vocab"], answers: Tensor) -> Tensor:
    """The mean over prompts of the clean answer's logit minus the corrupted answer's, at the
    last position."""
    last = logits[:, -1]
    return (last.gather(-1, answers[:, :1].to(last.device))
            - last.gather(-1, answers[:, 1:].to(last.device))).mean()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write both tables and the summary here")
    args = parser.parse_args()
    model = HookedVLLM.from_pretrained(smollm2_path(), dtype="float32")
    clean_tokens, corrupted_tokens, answers = prompts(model)
    clean_logits, clean_cache = model.run_with_cache(clean_tokens, names_filter=lambda n: "hook_z" in n)
    corrupted_logits = model(corrupted_tokens)
    clean_diff = float(logit_diff(clean_logits, answers))
    corrupted_diff = float(logit_diff(corrupted_logits, answers))
    print(f"logit difference: clean {clean_diff:.4f}, corrupted {corrupted_diff:.4f}")

    def metric(logits: Tensor) -> Tensor:  # 0 at the corrupted run, 1 at the clean one
        return (logit_diff(logits, answers) - corrupted_diff) / (clean_diff - corrupted_diff)

    start = time.perf_counter()
    activation = patching.get_act_patch_attn_head_out_all_pos(
        model, corrupted_tokens, clean_cache, metric).float().cpu()
    activation_s = time.perf_counter() - start
    start = time.perf_counter()
    attribution = patching.attribution(model, corrupted_tokens, clean_cache, metric, "z",
                                       index_axis_names=("layer", "head")).float().cpu()
    attribution_s = time.perf_counter() - start

    correlation = float(torch.corrcoef(torch.stack([activation.flatten(),
                                                    attribution.flatten()]))[0, 1])
    n_heads = model.cfg.n_heads

    def top(table: Tensor) -> list[str]:
        return [f"L{int(i) // n_heads}H{int(i) % n_heads}"
                for i in table.flatten().abs().argsort(descending=True)[:TOP]]

    by_activation, by_attribution = top(activation), top(attribution)
    shared = len(set(by_activation) & set(by_attribution))
    print(f"{activation.numel()} heads: activation patching {activation_s:.1f} s, "
          f"attribution patching {attribution_s:.1f} s")
    print(f"correlation of the two tables: {correlation:.3f}")
    print(f"top {TOP} heads by |effect|, activation patching:  {' '.join(by_activation)}")
    print(f"top {TOP} heads by |effect|, attribution patching: {' '.join(by_attribution)}")
    print(f"heads in both top {TOP}s: {shared}")
    if args.json:
        args.json.write_text(json.dumps({
            "clean_logit_diff": clean_diff, "corrupted_logit_diff": corrupted_diff,
            "activation_s": activation_s, "attribution_s": attribution_s,
            "correlation": correlation, "top_activation": by_activation,
            "top_attribution": by_attribution, "shared_top": shared,
            "activation": activation.tolist(), "attribution": attribution.tolist(),
        }, indent=1))
    model.close()  # the engine and the twin: their memory goes


if __name__ == "__main__":
    main()
