"""Editing with TransformerLens hook functions: edits reach the model exactly as the same edit in
HuggingFace does, stay within their request, and failures reach the caller cleanly."""

import pytest
import torch
from torch import Tensor, nn

from vlens.parity.reference import load_hf
from vlens.runtime.hooks import HookError
from vlens.testing import tiny_model

TEXT = "Steering vectors move the residual stream"
LAYER = 1


def hf_edit(model: nn.Module, name: str, vector: Tensor):
    """The HuggingFace hook that makes the same edit as adding ``vector`` at vlens's ``name``."""
    layer = model.model.layers[LAYER]

    def add_to_output(_m, _a, output):
        if isinstance(output, tuple):
            return (output[0] + vector, *output[1:])
        return output + vector

    def add_to_input(_m, args):
        return (args[0] + vector,)

    def add_to_hidden_states(_m, args, kwargs):
        if args:
            return (args[0] + vector, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": kwargs["hidden_states"] + vector}

    if name == "hook_resid_pre":
        return layer.register_forward_pre_hook(add_to_hidden_states, with_kwargs=True)
    if name == "hook_resid_mid":  # the attention output feeds the residual sum only
        return layer.self_attn.register_forward_hook(add_to_output)
    if name == "hook_resid_post":
        return layer.register_forward_hook(add_to_output)
    if name == "attn.hook_z":
        return layer.self_attn.o_proj.register_forward_pre_hook(add_to_input)
    if name == "attn.hook_q":
        return layer.self_attn.q_proj.register_forward_hook(add_to_output)
    if name == "mlp.hook_post":
        return layer.mlp.down_proj.register_forward_pre_hook(add_to_input)
    raise ValueError(name)


def vector_for(model, name: str) -> Tensor:
    """A fixed random edit of the right width (per head for z and q)."""
    generator = torch.Generator().manual_seed(7)
    cfg = model.cfg
    width = {"attn.hook_z": (cfg.n_heads, cfg.d_head), "attn.hook_q": (cfg.n_heads, cfg.d_head),
             "mlp.hook_post": (cfg.d_mlp,)}.get(name, (cfg.d_model,))
    return torch.randn(width, generator=generator)


@pytest.mark.parametrize(
    "name",
    ["hook_resid_pre", "hook_resid_mid", "hook_resid_post", "attn.hook_z", "mlp.hook_post", "attn.hook_q"],
)
def test_added_vector_matches_huggingface(hooked, rotary_arch, name):
    model = hooked(rotary_arch)
    vector = vector_for(model, name)

    def add(value: Tensor, hook) -> Tensor:
        return value + vector

    later = [f"blocks.{i}.hook_resid_post" for i in range(LAYER, model.cfg.n_layers)]
    with model.hooks(fwd_hooks=[(f"blocks.{LAYER}.{name}", add)]):
        logits, cache = model.run_with_cache(TEXT, names_filter=later)
    hf = load_hf(tiny_model(rotary_arch))
    handle = hf_edit(hf, name, vector.flatten())
    try:
        with torch.no_grad():
            out = hf(model.to_tokens(TEXT), output_hidden_states=True)
    finally:
        handle.remove()
    unedited, _ = model.run_with_cache(TEXT, names_filter=[])
    assert (unedited - logits).abs().max() > 1e-2, "the edit changed nothing"
    # fp32 parity tolerance (see parity/compare.py), applied per element with a small floor.
    torch.testing.assert_close(logits[0], out.logits[0], rtol=1e-4, atol=1e-4)
    for i in range(LAYER, model.cfg.n_layers - 1):
        torch.testing.assert_close(
            cache[f"blocks.{i}.hook_resid_post"][0], out.hidden_states[i + 1][0], rtol=1e-4, atol=1e-4
        )


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
    vector = torch.randn(model.cfg.d_model) * 4
    steer = [("blocks.1.hook_resid_post", lambda x, hook: x + vector)]
    both = model.generate([a, b], max_new_tokens=8, do_sample=False, prompt_hooks=[steer, []],
                          return_type="tokens")
    assert both[1] == model.generate(b, max_new_tokens=8, do_sample=False, return_type="tokens")[0]
    assert both[0] == model.generate(a, max_new_tokens=8, do_sample=False, fwd_hooks=steer,
                                     return_type="tokens")[0]
    assert both[0] != model.generate(a, max_new_tokens=8, do_sample=False, return_type="tokens")[0]

    def steer_first(x: Tensor, hook) -> Tensor | None:
        return x + vector if hook.request == 0 else None

    with model.hooks(fwd_hooks=[("blocks.1.hook_resid_post", steer_first)]):
        _, mixed = model.run_with_cache([a, b], names_filter="blocks.2.hook_resid_post")
    _, alone = model.run_with_cache(b, names_filter="blocks.2.hook_resid_post")
    torch.testing.assert_close(mixed.unpadded("blocks.2.hook_resid_post", 1), alone["blocks.2.hook_resid_post"][0])


def test_hook_point_surface_and_decode_steps(hooked):
    model = hooked("llama")
    seen: list[tuple[int, list[int], bool]] = []

    def record(x: Tensor, hook) -> None:
        assert hook.name == "blocks.2.hook_resid_pre" and hook.layer() == 2
        hook.ctx["calls"] = hook.ctx.get("calls", 0) + 1
        seen.append((hook.request, hook.positions.tolist(), hook.is_prefill))

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
    with pytest.raises(HookError, match=r"on blocks.1.hook_resid_post returned shape \(3, 3\); expected \(1, 3, 128\)"):
        model.run_with_hooks("Hello", fwd_hooks=[("blocks.1.hook_resid_post", lambda x, h: x[:, :, :3][0])])
    with pytest.raises(HookError, match="dtype"):
        model.run_with_hooks("Hello", fwd_hooks=[("blocks.1.hook_resid_post", lambda x, h: x.double())])
    assert model.run_with_hooks("Hello").shape[0] == 1


def test_names_that_cannot_be_edited(hooked):
    model = hooked("llama")
    with pytest.raises(ValueError, match="rebuilds it afterwards from .*hook_rot_q"):
        model.add_hook("blocks.0.attn.hook_pattern", lambda x, h: None)
    with pytest.raises(HookError, match="cannot be written back"):
        model.run_with_hooks("Hi", fwd_hooks=[("blocks.0.ln1.hook_scale", lambda x, h: x * 2)])
    def double_in_place(x, hook) -> None:
        x.mul_(2)

    with pytest.raises(HookError, match="cannot be written back"):  # an in-place edit too
        model.run_with_hooks("Hi", fwd_hooks=[("blocks.0.ln1.hook_scale", double_in_place)])
    model.run_with_hooks("Hi", fwd_hooks=[("blocks.0.ln1.hook_scale", lambda x, h: None)])  # a look
    with pytest.raises(ValueError, match="backward"):
        model.add_hook("blocks.0.hook_resid_pre", lambda x, h: None, dir="bwd")


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
