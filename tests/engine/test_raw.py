"""Raw vLLM locations as hook names: readable, writable, narrowed per request; clear errors for
modules that cannot be one."""

import pytest
import torch

from vlens.names.resolve import UnknownHookName

TEXTS = ["Hello raw world", "A second, longer prompt in the same batch"]


def test_raw_output_equals_canonical_name(hooked):
    model = hooked("llama")
    names = ["model.layers.1.mlp.act_fn.output", "blocks.1.mlp.hook_post",
             "model.layers.1.self_attn.qkv_proj.output", "blocks.1.attn.hook_q",
             "model.layers.2.input.hidden_states", "model.layers.2.input.2", "blocks.2.hook_resid_pre"]
    _, cache = model.run_with_cache(TEXTS, names_filter=names)
    for i in range(2):
        post = cache.unpadded("blocks.1.mlp.hook_post", i)
        assert torch.equal(cache.unpadded("model.layers.1.mlp.act_fn.output", i), post)
        qkv = cache.unpadded("model.layers.1.self_attn.qkv_proj.output", i)  # (tensor, bias)[0]
        q = cache.unpadded("blocks.1.attn.hook_q", i)
        assert torch.equal(qkv[:, : q[0].numel()], q.flatten(1))
        hidden, residual = (cache.unpadded(f"model.layers.2.input.{p}", i) for p in ("hidden_states", "2"))
        torch.testing.assert_close(hidden + residual, cache.unpadded("blocks.2.hook_resid_pre", i))


def test_raw_edit_in_place_reaches_the_model(hooked):
    model = hooked("llama")

    def zero(x, hook):
        x[:] = 0

    with model.hooks(fwd_hooks=[("model.layers.1.mlp.act_fn.output", zero)]):
        _, edited = model.run_with_cache(TEXTS[0], names_filter="blocks.1.hook_mlp_out")
    assert torch.all(edited["blocks.1.hook_mlp_out"] == 0)


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("model.layers.1.self_attn.rotary_emb.output", "shared by 3 places"),
        ("lm_head.output", "never runs as a module"),
        ("model.output", "never runs as a module"),
        ("model.layers.1.input.hidden", "has no argument 'hidden'"),
    ],
)
def test_locations_that_cannot_be_hooked(hooked, name, message):
    with pytest.raises(ValueError, match=message):
        hooked("llama").run_with_cache("x", names_filter=name)


def test_inputs_read_every_argument_of_the_call(hooked):
    model = hooked("llama")
    names = ["model.layers.0.inputs", "model.layers.2.inputs", "blocks.2.hook_resid_pre"]
    _, cache = model.run_with_cache(TEXTS, names_filter=names)
    assert "model.layers.2.inputs" in cache
    first, later = cache["model.layers.0.inputs"], cache["model.layers.2.inputs"]
    assert list(first) == ["positions", "hidden_states"]  # layer 0's residual is None
    assert list(later) == ["positions", "hidden_states", "residual"]
    torch.testing.assert_close(later["hidden_states"] + later["residual"],
                               cache["blocks.2.hook_resid_pre"])
    assert torch.equal(later["positions"][1, : len(later["positions"][1])],
                       torch.arange(later["positions"].shape[1]))


def test_a_hook_on_all_of_a_calls_inputs_names_each_argument(hooked):
    with pytest.raises(ValueError, match="hook one of them: model.layers.1.mlp.act_fn.input.0"):
        hooked("llama").add_hook("model.layers.1.mlp.act_fn.inputs", lambda x, h: None)


def test_unknown_module_lists_near_paths(hooked):
    with pytest.raises(UnknownHookName, match="Did you mean: model.layers.1.mlp.act_fn"):
        hooked("llama").add_hook("model.layers.1.mlp.actfn.output", lambda x, h: None)
