"""The logit lens: what each layer's residual stream would predict if the model stopped there.

Each layer's ``hook_resid_post`` goes through the model's own final norm (``model.ln_final``:
RMSNorm or LayerNorm with its weight, bias and epsilon, as its mapping's weight names say) and
unembedding (``model.W_U``, ``model.b_U``), read from the checkpoint, and the logits' scaling and
soft cap where the model has them, exactly as the model treats its last layer's output.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import torch
from jaxtyping import Float
from torch import Tensor

from vlens.hooked.model import HookedVLLM


@dataclass(frozen=True)
class LensView:
    """Top tokens per layer (rows) and position (columns) for one prompt."""

    tokens: list[str]
    top_tokens: list[list[str]]  # [layer][position]
    top_probs: Float[Tensor, "layer pos"]


def lens_logits(model: HookedVLLM, prompt: str) -> Float[Tensor, "layer pos d_vocab"]:
    """Each layer's ``hook_resid_post`` through the final norm and the unembedding, in fp32."""
    names = [f"blocks.{layer}.hook_resid_post" for layer in range(model.cfg.n_layers)]
    _, cache = model.run_with_cache(prompt, names_filter=names, return_type=None)
    resid = torch.stack([cache[name][0] for name in names]).float()  # [layer, pos, d_model]
    logits = model.ln_final(resid) @ model.W_U.float() + model.b_U.float()
    return model.checkpoint.analysis.output_logits(logits)


def logit_lens(model: HookedVLLM, prompt: str) -> LensView:
    probs = lens_logits(model, prompt).softmax(-1)
    top_probs, top_ids = probs.max(-1)
    ids = model.token_lists(prompt)[0]
    return LensView(
        tokens=[model.to_string([token]) for token in ids],
        top_tokens=[[model.to_string([t]) for t in row] for row in top_ids.tolist()],
        top_probs=top_probs,
    )


def format_lens(view: LensView, width: int = 10) -> str:
    """A plain-text table: one row per layer, one column per prompt position, whitespace shown
    by markers (:func:`shown`) and their legend under the table."""

    def cell(text: str) -> str:
        return shown(text)[:width].ljust(width)

    header = "layer | " + " ".join(cell(token) for token in view.tokens)
    lines = [header, "-" * len(header)]
    for layer, row in enumerate(view.top_tokens):
        lines.append(f"{layer:>5} | " + " ".join(cell(token) for token in row))
    return "\n".join([*lines, f"({LEGEND})"])


def require_matplotlib() -> None:
    """Plots need matplotlib, which vlens does not install by itself."""
    if importlib.util.find_spec("matplotlib") is None:
        raise ModuleNotFoundError(
            "plotting the logit lens needs matplotlib: pip install matplotlib"
        )


def plot_lens(view: LensView, path: str | Path, title: str = "") -> None:
    """A PNG heatmap: the top token's probability per layer (rows, the last at the top) and
    position (columns), with the top token written in each cell."""
    require_matplotlib()
    from matplotlib.figure import Figure  # no pyplot: no global figure state, no GUI backend

    probs = view.top_probs.float().numpy()
    n_layers, n_positions = probs.shape
    figure = Figure(figsize=(1.2 * n_positions + 2, 0.4 * n_layers + 1.5), layout="constrained")
    axes = figure.add_subplot()
    image = axes.imshow(probs, cmap="Blues", vmin=0, vmax=1, aspect="auto", origin="lower")
    for layer, row in enumerate(view.top_tokens):
        for position, token in enumerate(row):
            color = "white" if probs[layer, position] > 0.6 else "black"
            label = shown(token)
            axes.text(
                position, layer, label[:12], ha="center", va="center", fontsize=7, color=color
            )
    axes.set_xticks(range(n_positions), [shown(token) for token in view.tokens], rotation=45)
    axes.set_yticks(range(n_layers))
    axes.set_xlabel("position (input token)")
    axes.set_ylabel("layer")
    axes.set_title(title)
    figure.colorbar(image, ax=axes, label="top-token probability")
    figure.savefig(path, dpi=120)


#: Whitespace a table cell would show as blank (or not at all), and its visible marker.
MARKERS = {" ": "␣", "\n": "↵", "\t": "⇥", "\xa0": "⍽"}
LEGEND = "␣ space, ↵ newline, ⇥ tab, ⍽ no-break space"


def shown(token: str) -> str:
    """A token as one visible line: whitespace as its marker (``" Paris"`` is ``"␣Paris"``), any
    other character a terminal would not print as its escape (``"\\x00"``), so that tokens
    that differ look different."""
    return "".join(
        MARKERS.get(char) or (char if char.isprintable() else repr(char)[1:-1]) for char in token
    )
