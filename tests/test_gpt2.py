"""GPT-2: the mixed-batch check of test_batching.py, and every writable name edited exactly as the
same edit in HuggingFace (GPT-2 has no fused residual, so its write rules differ from Llama's)."""

from collections.abc import Callable

import pytest
import test_batching
import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from vlens.parity.reference import load_hf
from vlens.runtime.hooks import HookError
from vlens.testing import tiny_model

TEXT = "Steering vectors move the residual stream"
LAYER = 1


def test_mixed_batch_equals_each_prompt_alone(hooked):
    test_batching.test_mixed_batch_equals_each_prompt_alone(hooked, "gpt2")


@pytest.fixture(scope="module")
def hf_gpt2() -> nn.Module:
    return load_hf(tiny_model("gpt2"))


def hf_edit(model: nn.Module, name: str, vector: Tensor) -> RemovableHandle:
    """The HuggingFace hook that makes the same edit as adding ``vector`` (``[pos, width]``) at
    vlens's ``name``."""
    block = model.transformer.h[LAYER]
    d_model = model.config.hidden_size

    def add_to_output(start: int = 0) -> Callable:
        def hook(_m: nn.Module, _args: tuple, output: Tensor | tuple) -> Tensor | tuple:
            first = output[0] if isinstance(output, tuple) else output
            first = first.clone()
            first[..., start : start + vector.shape[-1]] += vector
            return (first, *output[1:]) if isinstance(output, tuple) else first

        return hook

    def add_to_input(_m: nn.Module, args: tuple) -> tuple:
        return (args[0] + vector, *args[1:])

    sites = {
        "hook_embed": (model.transformer.wte, add_to_output()),
        "hook_pos_embed": (model.transformer.wpe, add_to_output()),
        f"blocks.{LAYER}.hook_resid_pre": (block, "input"),
        # resid_mid, attn_out: the attention output feeds only the residual sum
        f"blocks.{LAYER}.hook_resid_mid": (block.attn, add_to_output()),
        f"blocks.{LAYER}.hook_attn_out": (block.attn, add_to_output()),
        f"blocks.{LAYER}.hook_resid_post": (block, add_to_output()),
        f"blocks.{LAYER}.attn.hook_q": (block.attn.c_attn, add_to_output(0)),
        f"blocks.{LAYER}.attn.hook_k": (block.attn.c_attn, add_to_output(d_model)),
        f"blocks.{LAYER}.attn.hook_v": (block.attn.c_attn, add_to_output(2 * d_model)),
        f"blocks.{LAYER}.attn.hook_z": (block.attn.c_proj, "input"),
        f"blocks.{LAYER}.mlp.hook_pre": (block.mlp.c_fc, add_to_output()),
        f"blocks.{LAYER}.mlp.hook_post": (block.mlp.c_proj, "input"),
        f"blocks.{LAYER}.hook_mlp_out": (block.mlp, add_to_output()),
    }
    module, hook = sites[name]
    if hook == "input":
        return module.register_forward_pre_hook(add_to_input)
    return module.register_forward_hook(hook)


EDITABLE = [
    "hook_embed",
    "hook_pos_embed",
    *(
        f"blocks.{LAYER}.{name}"
        for name in (
            "hook_resid_pre", "hook_resid_mid", "hook_attn_out", "hook_resid_post", "attn.hook_q",
            "attn.hook_k", "attn.hook_v", "attn.hook_z", "mlp.hook_pre", "mlp.hook_post",
            "hook_mlp_out",
        )
    ),
]


@pytest.mark.parametrize("name", EDITABLE)
def test_added_vector_matches_huggingface(hooked, hf_gpt2, name):
    model = hooked("gpt2")
    _, plain = model.run_with_cache(TEXT, names_filter=name)
    # One vector per position: one vector for every key would shift each query's scores alike.
    vector = torch.randn(plain[name].shape[1:], generator=torch.Generator().manual_seed(7))

    def add(value: Tensor, hook) -> Tensor:
        return value + vector

    last = f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"
    with model.hooks(fwd_hooks=[(name, add)]):
        logits, cache = model.run_with_cache(TEXT, names_filter=[name, last])
    torch.testing.assert_close(cache[name], plain[name] + vector)
    handle = hf_edit(hf_gpt2, name, vector.flatten(1))
    try:
        with torch.no_grad():
            out = hf_gpt2(model.to_tokens(TEXT), output_hidden_states=True)
    finally:
        handle.remove()
    unedited, _ = model.run_with_cache(TEXT, names_filter=[])
    assert (unedited - logits).abs().max() > 1e-2, "the edit changed nothing"
    torch.testing.assert_close(logits[0], out.logits[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "name", ["blocks.0.ln1.hook_scale", "blocks.0.ln2.hook_normalized", "blocks.0.hook_k_input"]
)
def test_computed_names_are_read_only(hooked, name):
    with pytest.raises(HookError, match="cannot be written back"):
        hooked("gpt2").run_with_hooks("Hi", fwd_hooks=[(name, lambda x, h: x * 2)])
