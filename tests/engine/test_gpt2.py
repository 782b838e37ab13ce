"""GPT-2's computed names are read-only: a hook function that changes one is refused, as with the
other architectures. (GPT-2's edits are checked against HuggingFace in test_editing.py, its mixed
batches in test_batching.py, each parametrized over the architectures.)"""

import pytest

from vlens.runtime.transfer.messages import HookError


@pytest.mark.parametrize(
    "name", ["blocks.0.ln1.hook_scale", "blocks.0.ln2.hook_normalized", "ln_final.hook_scale"]
)
def test_computed_names_are_read_only(hooked, name: str):
    with pytest.raises(HookError, match="cannot be written back"):
        hooked("gpt2").run_with_hooks("Hi", fwd_hooks=[(name, lambda x, h: x * 2)])
