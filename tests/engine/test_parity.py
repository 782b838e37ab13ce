"""Every name of every served architecture (each tiny model the mapping files declare) against
HuggingFace, and against TransformerLens's bridge where it gives a reference (fp32)."""

import pytest

from vlens.parity.compare import FP32_MAX_REL
from vlens.parity.run import run_parity
from vlens.testing.tiny import ARCHS, tiny_mapping, tiny_model


@pytest.mark.parametrize("arch", ARCHS)
def test_every_name_matches_references(hooked, arch):
    model = hooked(arch)
    rows, uncovered = run_parity(model, tiny_model(arch))
    assert not uncovered, f"names with no reference: {uncovered}"
    with_bridge = tiny_mapping(arch).no_bridge_reference is None
    expected = {"HuggingFace", "TransformerLens"} if with_bridge else {"HuggingFace"}
    assert {row.reference for row in rows} == expected
    assert {row.name for row in rows} == set(model.hook_names)
    assert {row.mode for row in rows} == {"prefill", "decode"}
    failures = [row for row in rows if not row.within(FP32_MAX_REL)]
    assert not failures, failures
