"""Editing with TransformerLens hook functions: edits reach the model exactly as the same edit in
HuggingFace does, stay within their request, and failures reach the caller cleanly."""

import functools
from collections.abc import Callable

import pytest
import torch
from hf_edits import forward_with_added
from torch import Tensor, nn

from vlens.parity.reference import load_hf
from vlens.runtime.transfer.messages import HookError
from vlens.testing.tiny import ARCHS, tiny_model

TEXT = "Steering vectors move the residual stream"
SHORT = "The cat sat"
LAYER = 1

ROTARY_EDITABLE = ("hook_resid_pre", "hook_resid_mid", "hook_resid_post", "attn.hook_z",
                   "mlp.hook_post", "attn.hook_q")
GPT2_EDITABLE = ("hook_resid_pre", "hook_resid_mid", "hook_attn_out", "hook_resid_post",
                 "attn.hook_q", "attn.hook_k", "attn.hook_v", "attn.hook_z", "mlp.hook_pre",
                 "mlp.hook_post", "hook_mlp_out")
#: The names each architecture's edits are checked at. GPT-2 has no fused residual, so its write
#: rules differ from Llama's and Qwen3's.
EDITABLE = {
    "llama": [f"blocks.{LAYER}.{name}" for name in ROTARY_EDITABLE],
    "qwen3": [f"blocks.{LAYER}.{name}" for name in ROTARY_EDITABLE],
    "gpt2": ["hook_embed", "hook_pos_embed", *(f"blocks.{LAYER}.{name}" for name in GPT2_EDITABLE)],
}


@pytest.fixture(scope="module")
def huggingface() -> Callable[[str], nn.Module]:
    """``huggingface("gpt2")``: the tiny checkpoint in HuggingFace transformers, loaded once."""
    return functools.cache(lambda arch: load_hf(tiny_model(arch)))


@pytest.mark.parametrize(
    ("arch", "name"), [(arch, name) for arch, names in EDITABLE.items() for name in names]
)
def test_added_vector_matches_huggingface(hooked, huggingface, arch: str, name: str):
    model = hooked(arch)
    plain_logits, plain = model.run_with_cache(TEXT, names_filter=name)
    # One vector per position: one vector for every key would shift each query's scores alike.
    vector = torch.randn(plain[name].shape[1:], generator=torch.Generator().manual_seed(7))

    def add(value: Tensor, hook) -> Tensor:
        return value + vector

    # HuggingFace's hidden state i + 1 is blocks.i.hook_resid_post, except the last (after the
    # final norm).
    later = [f"blocks.{i}.hook_resid_post" for i in range(LAYER, model.cfg.n_layers - 1)]
    with model.hooks(fwd_hooks=[(name, add)]):
        logits, edited = model.run_with_cache(TEXT, names_filter=lambda n: n == name or n in later)
    torch.testing.assert_close(edited[name], plain[name] + vector)
    assert (plain_logits - logits).abs().max() > 1e-2, "the edit changed nothing"
    tokens = model.to_tokens(TEXT)
    reference = forward_with_added(huggingface(arch), tokens, name, vector.flatten(1))
    # fp32 parity tolerance (see parity/compare.py), applied per element with a small floor.
    torch.testing.assert_close(logits[0], reference.logits[0], rtol=1e-4, atol=1e-4)
    for i, stream in enumerate(later, start=LAYER + 1):
        torch.testing.assert_close(
            edited[stream][0], reference.hidden_states[i][0], rtol=1e-4, atol=1e-4
        )


@pytest.mark.parametrize("arch", ARCHS)
def test_a_steered_residual_stream_matches_huggingface_in_every_architecture(hooked, huggingface,
                                                                             arch: str):
    """A vector added at ``blocks.1.hook_resid_post`` gives HuggingFace's logits with the same
    vector added to its layer 1's output (fp32, the parity tolerance per element). The prompt
    is shorter than every tiny model's sliding window, whose length vLLM counts differently for
    Cohere 2."""
    model = hooked(arch)
    name = f"blocks.{LAYER}.hook_resid_post"
    plain = model(SHORT)
    vector = torch.randn(plain.shape[1], model.cfg.d_model, generator=torch.Generator().manual_seed(5))
    logits = model.run_with_hooks(SHORT, fwd_hooks=[(name, lambda value, hook: value + vector)])
    assert (plain - logits).abs().max() > 1e-3, "the edit changed nothing"
    reference = forward_with_added(huggingface(arch), model.to_tokens(SHORT), name, vector)
    torch.testing.assert_close(logits[0], reference.logits[0], rtol=1e-4, atol=1e-4)


def test_in_place_edit_returning_none_reaches_the_model(hooked):
    model = hooked("llama")

    def zero_head(z: Tensor, hook) -> None:
        z[:, :, 1] = 0.0

    _, cache = model.run_with_cache(TEXT, names_filter="blocks.0.attn.hook_z")
    with model.hooks(fwd_hooks=[("blocks.0.attn.hook_z", zero_head)]):
        _, edited = model.run_with_cache(TEXT, names_filter=["blocks.0.attn.hook_z", "blocks.0.hook_attn_out"])
    assert torch.all(edited["blocks.0.attn.hook_z"][:, :, 1] == 0)
    assert cache["blocks.0.attn.hook_z"][:, :, 1].abs().sum() > 0
    _, plain = model.run_with_cache(TEXT, names_filter="blocks.0.hook_attn_out")
    assert not torch.allclose(edited["blocks.0.hook_attn_out"], plain["blocks.0.hook_attn_out"])


def test_steering_one_request_leaves_the_other_alone(hooked):
    model = hooked("qwen3")
    a, b = "The first prompt is steered", "The second one is not, and it is longer than the first"
    vector = torch.randn(model.cfg.d_model, generator=torch.Generator().manual_seed(3)) * 4
    steer = [("blocks.1.hook_resid_post", lambda x, hook: x + vector)]
    def new(prompt: str, **hooks) -> list[int]:
        return model.generate(prompt, max_new_tokens=8, do_sample=False, return_type="result",
                              **hooks)[0].tokens

    both = model.generate([a, b], max_new_tokens=8, do_sample=False, prompt_hooks=[steer, []],
                          return_type="result")
    assert both[1].tokens == new(b)
    assert both[0].tokens == new(a, fwd_hooks=steer)
    assert both[0].tokens != new(a)

    _, mixed = model.run_with_cache([a, b], names_filter="blocks.2.hook_resid_post",
                                    prompt_hooks=[steer, []])
    _, alone = model.run_with_cache(b, names_filter="blocks.2.hook_resid_post")
    torch.testing.assert_close(mixed.unpadded("blocks.2.hook_resid_post", 1), alone["blocks.2.hook_resid_post"][0])


def test_hook_point_surface_and_decode_steps(hooked):
    model = hooked("llama")
    seen: list[tuple[int, list[int], bool]] = []

    def record(x: Tensor, hook) -> None:
        assert hook.name == "blocks.2.hook_resid_pre" and hook.layer() == 2
        hook.ctx["calls"] = hook.ctx.get("calls", 0) + 1
        seen.append((hook.request, hook.positions.tolist()[0], hook.is_prefill))

    prompt = model.token_lists("Count the steps")[0]
    model.generate("Count the steps", max_new_tokens=4, do_sample=False,
                   fwd_hooks=[("blocks.2.hook_resid_pre", record)])
    assert seen[0] == (0, list(range(len(prompt))), True)
    assert seen[1:] == [(0, [len(prompt) + i], False) for i in range(3)]


def test_hook_exception_reaches_caller_and_engine_keeps_serving(hooked):
    model = hooked("llama")

    def broken(x: Tensor, hook) -> None:
        raise ValueError("boom")

    with pytest.raises(HookError, match=r"broken on blocks.0.attn.hook_z raised ValueError\('boom'\)"):
        model.generate("Hello", max_new_tokens=3, fwd_hooks=[("blocks.0.attn.hook_z", broken)])
    assert len(model.generate("Hello", max_new_tokens=3, return_type="tokens")[0]) > 1


def test_wrong_shape_or_dtype_is_named(hooked):
    model = hooked("llama")
    n = model.to_tokens("Hello").shape[1]
    expected = rf"on blocks.1.hook_resid_post returned shape \({n}, 3\); expected \(1, {n}, 128\)"
    with pytest.raises(HookError, match=expected):
        model.run_with_hooks("Hello", fwd_hooks=[("blocks.1.hook_resid_post", lambda x, h: x[:, :, :3][0])])
    with pytest.raises(HookError, match="dtype"):
        model.run_with_hooks("Hello", fwd_hooks=[("blocks.1.hook_resid_post", lambda x, h: x.double())])
    assert model.run_with_hooks("Hello").shape[0] == 1


def test_names_that_cannot_be_edited(hooked):
    model = hooked("llama")
    with pytest.raises(ValueError, match="sampler.hook_tokens cannot carry a hook"):
        model.add_hook("sampler.hook_tokens", lambda x, h: None)
    with pytest.raises(HookError, match="cannot be written back"):
        model.run_with_hooks("Hi", fwd_hooks=[("blocks.0.ln1.hook_scale", lambda x, h: x * 2)])
    def double_in_place(x, hook) -> None:
        x.mul_(2)

    with pytest.raises(HookError, match="cannot be written back"):  # an in-place edit too
        model.run_with_hooks("Hi", fwd_hooks=[("blocks.0.ln1.hook_scale", double_in_place)])
    model.run_with_hooks("Hi", fwd_hooks=[("blocks.0.ln1.hook_scale", lambda x, h: None)])  # a look


def test_add_and_reset_hooks(hooked):
    model = hooked("llama")
    calls: list[str] = []
    model.add_hook("blocks.0.hook_resid_post", lambda x, h: calls.append("temp"))
    model.add_hook(lambda n: n == "blocks.1.hook_resid_post", lambda x, h: calls.append("perm"), is_permanent=True)
    model.run_with_hooks("Hi")
    assert calls == ["temp", "perm"]
    model.reset_hooks()
    model.run_with_hooks("Hi")
    assert calls == ["temp", "perm", "perm"]
    model.reset_hooks(including_permanent=True)
    model.run_with_hooks("Hi")
    assert calls == ["temp", "perm", "perm"]


@pytest.mark.parametrize("name", ["hook_resid_pre", "hook_resid_mid", "hook_resid_post"])
def test_replaced_residual_holds_the_hooks_value_exactly(hooked, name: str):
    """A residual written over vLLM's fused ``(hidden, residual)`` pair holds the hook's value,
    not the value plus rounding: zeros stay zeros through the next RMSNorm, and a bias-free
    Llama's attention then outputs exact zeros (a residue of 1e-6 would come out of the norm
    amplified to 1e-3)."""
    layer = LAYER if name != "hook_resid_post" else LAYER - 1
    after = f"blocks.{LAYER}.attn.hook_z" if name != "hook_resid_mid" else f"blocks.{LAYER}.mlp.hook_post"
    with hooked("llama").hooks(fwd_hooks=[(f"blocks.{layer}.{name}", lambda x, hook: x * 0)]):
        _, cache = hooked("llama").run_with_cache(TEXT, names_filter=after)
    assert cache[after].abs().max().item() == 0.0
