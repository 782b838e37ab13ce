"""Every name of every supported architecture against HuggingFace and TransformerLens (fp32)."""

import pytest

from vlens.parity.compare import FP32_MAX_REL
from vlens.parity.run import run_parity
from vlens.testing import tiny_model


@pytest.mark.parametrize("arch", ["qwen3", "llama", "gpt2", "mistral", "qwen2"])
def test_every_name_matches_references(hooked, arch):
    model = hooked(arch)
    rows, uncovered = run_parity(model, tiny_model(arch))
    assert not uncovered, f"names with no reference: {uncovered}"
    assert {row.reference for row in rows} == {"HuggingFace", "TransformerLens"}
    assert {row.name for row in rows} == set(model.hook_names)
    failures = [row for row in rows if not row.within(FP32_MAX_REL)]
    assert not failures, failures
