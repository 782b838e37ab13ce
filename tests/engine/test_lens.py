"""The logit lens through each model's own final norm and unembedding: at the last layer it must
be the model's own prediction, on every tiny model (RMSNorm and LayerNorm with bias, tied and
untied unembeddings, MLA)."""

import pytest
import torch

from vlens.analysis.lens import LensView, format_lens, lens_logits, logit_lens, shown
from vlens.testing.tiny import ARCHS

PROMPT = "The capital of France is Paris, and the capital"


@pytest.mark.parametrize("arch", ARCHS)
def test_last_layer_of_the_lens_is_the_models_prediction(hooked, arch):
    model = hooked(arch)
    logits = model(PROMPT)[0].float()  # [pos, d_vocab], the model's own output
    lens = lens_logits(model, PROMPT)
    assert lens.shape == (model.cfg.n_layers, *logits.shape)
    torch.testing.assert_close(lens[-1], logits, rtol=1e-4, atol=1e-4)

    view = logit_lens(model, PROMPT)
    probs = logits.softmax(-1)
    assert view.top_tokens[-1] == [model.to_string([t]) for t in probs.argmax(-1).tolist()]
    torch.testing.assert_close(view.top_probs[-1], probs.max(-1).values, rtol=1e-4, atol=1e-5)
    # Earlier layers are not the output: the lens reads each layer's own residual stream.
    assert not torch.allclose(lens[0], logits, rtol=1e-2, atol=1e-2)


def test_the_lens_table_shows_every_token_visibly():
    """Whitespace tokens are not blank cells, and tokens that differ look different."""
    tokens = [" Paris", "Paris", " ", "  ", "\xa0", "\n", "\t", "a\x00b"]
    cells = [shown(token) for token in tokens]
    assert cells == ["␣Paris", "Paris", "␣", "␣␣", "⍽", "↵", "⇥", "a\\x00b"]
    view = LensView(tokens=tokens, top_tokens=[tokens], top_probs=torch.ones(1, len(tokens)))
    header, _, row, legend = format_lens(view, width=8).splitlines()
    assert row.split(" | ", 1)[1].split() == cells
    assert "␣ space" in legend and "⍽ no-break space" in legend
