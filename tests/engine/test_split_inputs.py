"""Edits of TransformerLens's per-head attention inputs (``hook_q_input``, ``hook_k_input``,
``hook_v_input``, ``hook_attn_in``) land as in TransformerLens's own ``TransformerBridge`` with
``use_split_qkv_input`` / ``use_attn_in`` on the same checkpoint (fp32, ≤ 1e-4 of the largest
logit), on prompts of unequal lengths and decode steps; a look changes nothing; an architecture
whose projection the checkpoint's weights do not reproduce is refused."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import Tensor

from vlens.runtime.transfer.messages import HookError
from vlens.testing.tiny import tiny_model

TEXT = "The river ran past the old mill, and every morning"
OTHER = "A computer is a machine"
LAYER = 1
RELATIVE = 1e-4  # fp32 parity, relative to the largest logit


def split(kind: str) -> str:
    return f"blocks.{LAYER}.{kind}"


def push_head_1(value: Tensor, hook) -> None:
    """Head 1's copy of the block input moved along a fixed direction, at every position."""
    direction = torch.linspace(-1.0, 1.0, value.shape[-1], device=value.device)
    value[:, :, 1] += 3.0 * direction


def reverse_last_head(value: Tensor, hook) -> Tensor:
    """A new value: the last head's copy with its features in reverse order."""
    out = value.clone()
    out[:, :, -1] = value[:, :, -1].flip(-1)
    return out


@functools.cache
def bridge(arch: str, flag: str):
    from transformer_lens.model_bridge import TransformerBridge

    model = TransformerBridge.boot_transformers(str(tiny_model(arch)), device="cpu", dtype=torch.float32)
    model.enable_compatibility_mode(no_processing=True)
    getattr(model, flag)(True)
    return model


def assert_relative(actual: Tensor, expected: Tensor, tolerance: float = RELATIVE) -> None:
    error = (actual.float() - expected.float()).abs().max() / expected.float().abs().max()
    assert error <= tolerance, f"relative error {error:.2e} > {tolerance:.0e}"


CASES = [
    ("llama", "hook_q_input", push_head_1, "set_use_split_qkv_input"),
    ("llama", "hook_k_input", push_head_1, "set_use_split_qkv_input"),
    ("llama", "hook_v_input", reverse_last_head, "set_use_split_qkv_input"),
    ("gpt2", "hook_q_input", reverse_last_head, "set_use_split_qkv_input"),
    ("gpt2", "hook_v_input", push_head_1, "set_use_split_qkv_input"),
    ("gpt2", "hook_attn_in", push_head_1, "set_use_attn_in"),
    ("qwen3", "hook_k_input", push_head_1, "set_use_split_qkv_input"),  # q/k norms, grouped
    ("gemma2", "hook_q_input", push_head_1, "set_use_split_qkv_input"),  # 1 + w norms
    ("gpt_neox", "hook_v_input", reverse_last_head, "set_use_split_qkv_input"),  # per-head qkv
    ("olmo2", "hook_q_input", push_head_1, "set_use_split_qkv_input"),  # no norm before attention
]


@pytest.mark.parametrize(("arch", "kind", "function", "flag"), CASES,
                         ids=[f"{arch}-{kind}" for arch, kind, *_ in CASES])
def test_split_input_edits_equal_transformer_lens(hooked, arch, kind, function, flag):
    model = hooked(arch)
    other = "set_use_attn_in" if flag == "set_use_split_qkv_input" else "set_use_split_qkv_input"
    getattr(model, other)(False)  # the two exclude each other, as in TransformerLens
    getattr(model, flag)(True)
    try:
        name = split(kind)
        tokens = model.to_tokens(TEXT)
        with torch.no_grad():
            expected = bridge(arch, flag).run_with_hooks(tokens, fwd_hooks=[(name, function)])
        logits = model.run_with_hooks(TEXT, fwd_hooks=[(name, function)])
        assert_relative(logits, expected)
        plain = model.run_with_hooks(TEXT)
        assert (logits - plain).abs().max() > 1e-2, "the edit changed nothing"
    finally:  # the model is shared by the session's tests: leave its settings as found
        getattr(model, flag)(False)


def test_a_look_at_a_split_input_changes_nothing(hooked):
    model = hooked("llama")
    seen: list[Tensor] = []

    def look(value: Tensor, hook) -> None:
        assert hook.name == split("hook_q_input")
        seen.append(value.clone())

    plain = model.run_with_hooks([TEXT, OTHER])
    logits = model.run_with_hooks([TEXT, OTHER], fwd_hooks=[(split("hook_q_input"), look)])
    assert torch.equal(logits, plain)
    _, cache = model.run_with_cache([TEXT, OTHER], names_filter=[split("hook_q_input")])
    assert seen[0].shape == cache[split("hook_q_input")].shape
    torch.testing.assert_close(seen[0], cache[split("hook_q_input")], rtol=0, atol=0)


def test_split_edits_per_prompt_and_over_decode_steps(hooked):
    """A batch of unequal prompts, one edited through its own hook: the edited prompt's tokens
    equal those of the same edit alone (prefill and decode steps), the other's equal an unedited
    run's."""
    model = hooked("llama")
    name = split("hook_q_input")
    both = model.generate([TEXT, OTHER], max_new_tokens=5, do_sample=False, stop_at_eos=False,
                          return_type="result", prompt_hooks=[[(name, push_head_1)], []])
    alone = model.generate([TEXT], max_new_tokens=5, do_sample=False, stop_at_eos=False,
                           return_type="result", fwd_hooks=[(name, push_head_1)])
    plain = model.generate([OTHER], max_new_tokens=5, do_sample=False, stop_at_eos=False,
                           return_type="result")
    assert both[0] == alone[0] and both[1] == plain[0]
    unedited = model.generate([TEXT], max_new_tokens=5, do_sample=False, stop_at_eos=False,
                              return_type="result")
    assert alone[0] != unedited[0], "the edit changed nothing"


def test_a_projection_the_weights_do_not_reproduce_is_refused(hooked, monkeypatch):
    """Where recomputing the unedited copies does not give vLLM's value, the edit is refused
    with the reason, not written wrongly."""
    from vlens.runtime.hooks import split_inputs

    model = hooked("llama")
    real = split_inputs.Projection.__call__
    monkeypatch.setattr(split_inputs.Projection, "__call__",
                        lambda self, normed: real(self, normed) * 2)
    with pytest.raises(HookError, match="cannot write that edit into this architecture"):
        model.run_with_hooks(TEXT, fwd_hooks=[(split("hook_q_input"), push_head_1)])
    assert model.run_with_hooks(TEXT).shape[1] == len(model.to_tokens(TEXT)[0])  # engine runs on


def test_split_input_edits_on_a_compiled_engine_equal_the_eager_engine(hooked):
    """Declaring a split input in ``compiled_hooks`` declares where its hooks run (the block
    input and the projections): the same edit, the same logits."""
    eager = hooked("llama")
    compiled = hooked("llama", compiled_hooks=(split("hook_attn_in"), split("hook_v_input")))
    hooks = [(split("hook_v_input"), reverse_last_head)]
    torch.testing.assert_close(compiled.run_with_hooks([TEXT, OTHER], fwd_hooks=hooks),
                               eager.run_with_hooks([TEXT, OTHER], fwd_hooks=hooks),
                               rtol=1e-5, atol=1e-5)
