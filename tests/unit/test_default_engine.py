"""Which engine ``HookedVLLM.from_pretrained(path)`` gives without compiled names: on a GPU the
compiled one with hook functions at every name, where the architecture's compiled engine is
offered and ``enforce_eager=True`` is not asked for; on vLLM's CPU backend the eager one."""

from __future__ import annotations

import pytest

from vlens.engine import arguments
from vlens.mappings import all_mappings
from vlens.names.compiled import every_name


@pytest.mark.parametrize(("cpu", "user_args", "offered", "expected"), [
    (False, {}, True, True),
    (False, {"enforce_eager": False}, True, True),
    (False, {"enforce_eager": True}, True, False),
    (False, {}, False, False),
    (True, {}, True, False),
])
def test_the_default_engine_runs_hooks_in_the_graph_on_a_gpu_only(
    monkeypatch, cpu, user_args, offered, expected
) -> None:
    monkeypatch.setattr(arguments, "on_cpu", lambda: cpu)
    mapping = next(m for m in all_mappings() if m.compiled_graph == offered)
    assert arguments.hooks_in_graph_by_default(mapping, user_args) is expected


def test_the_default_engine_declares_every_name() -> None:
    assert every_name("blocks.0.attn.hook_pattern") and every_name("hook_embed")
