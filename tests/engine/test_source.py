"""Operations inside a module's forward as locations (``PATH.source.OP``): listed as vLLM runs
them, read per request equal to the canonical names they are, edited as those names are."""

from __future__ import annotations

import pytest
import torch

from vlens.names.mapping import HookSpec
from vlens.testing.tiny import tiny_archs

TEXTS = ["Hello source world", "A second, longer prompt in the same batch"]
NATIVE = tiny_archs(lambda mapping: mapping.model_impl == "auto")


def attention_path(model, layer: int) -> str | None:
    """The module whose forward turns q and k: the parent of the module ``hook_rot_q`` is read
    at, else (no rotary embedding) of the one ``hook_z`` is."""
    for name in ("hook_rot_q", "hook_z"):
        spec = model.checkpoint.hook_specs.get(f"blocks.{layer}.attn.{name}")
        if isinstance(spec, HookSpec):
            return spec.site.path.rsplit(".", 1)[0]
    return None


#: Architectures whose full-attention layers apply no rotary embedding.
NO_ROTARY_ON_FULL_LAYERS = ("cohere2", "exaone4")


def rotary_layer(model) -> int:
    """Layer 1, but in an architecture whose full-attention layers turn nothing, its first
    sliding layer: its rotary operation is listed in every layer's forward, run in those only."""
    config = model.checkpoint.hf_config
    if config.model_type in NO_ROTARY_ON_FULL_LAYERS:
        return config.layer_types.index("sliding_attention")
    return 1


@pytest.mark.parametrize("arch", NATIVE)
def test_rotary_and_split_operations_equal_the_canonical_names(hooked, arch):
    model = hooked(arch)
    layer = rotary_layer(model)
    path = attention_path(model, layer)
    if path is None:
        pytest.skip(f"{arch}: no hook_rot_q or hook_z read at a module")
    listed = [name.rsplit(".", 2)[-2] for name in model.source(path)]
    checks: dict[str, str] = {}  # operation location -> canonical name
    if "self_rotary_emb_0" in listed:
        rotary = f"{path}.source.self_rotary_emb_0.output"
        checks |= {f"{rotary}.0": f"blocks.{layer}.attn.hook_rot_q",
                   f"{rotary}.1": f"blocks.{layer}.attn.hook_rot_k"}
    split = next((op for op in ("qkv_split_0", "qkv_chunk_0") if op in listed), None)
    if split is not None:
        for element, letter in enumerate("qkv"):
            checks[f"{path}.source.{split}.output.{element}"] = f"blocks.{layer}.attn.hook_{letter}"
    if not checks:
        pytest.skip(f"{arch}: {path}'s forward has no rotary or q/k/v split operation: {listed}")
    _, cache = model.run_with_cache(TEXTS, names_filter=[*checks, *checks.values()])
    for i in range(len(TEXTS)):
        for location, name in checks.items():
            value, canonical = cache.unpadded(location, i), cache.unpadded(name, i)
            if value.numel() == canonical.numel():
                assert torch.equal(value.reshape(canonical.shape), canonical), (location, name)
                continue
            # MLA: the rotary embedding turns each head's last columns only (and one key
            # shared by every head), which hook_rot_q/k hold after the rest
            turned = value.reshape(len(value), -1, value.shape[-1])
            tail = canonical[..., -value.shape[-1] :]
            assert torch.equal(turned.expand_as(tail), tail), (location, name)


def test_a_listing_shows_the_forward_as_vllm_runs_it(hooked):
    listing = hooked("llama").source("model.layers.1.self_attn")
    assert listing.names == [
        f"model.layers.1.self_attn.source.{op}.output"
        for op in ("self_qkv_proj_0", "qkv_split_0", "self_rotary_emb_0", "self_attn_0",
                   "self_o_proj_0")
    ]
    assert "q, k = self.rotary_emb(positions, q, k)" in repr(listing)


def test_an_edit_at_an_operation_is_the_edit_at_its_canonical_name(hooked):
    model = hooked("llama")
    operation = "model.layers.1.self_attn.source.qkv_split_0.output.2"

    def halve(x, hook):
        return x / 2

    reference = model.run_with_hooks(TEXTS, fwd_hooks=[("blocks.1.attn.hook_v", halve)])
    edited = model.run_with_hooks(TEXTS, fwd_hooks=[(operation, halve)])
    plain = model(TEXTS)
    torch.testing.assert_close(edited, reference, rtol=1e-5, atol=1e-5)
    assert (edited - plain).abs().max() > 1e-3  # the edit changed the model


def test_an_operation_input_reads_the_argument(hooked):
    model = hooked("llama")
    rotary = "model.layers.1.self_attn.source.self_rotary_emb_0"  # (positions, q, k)
    _, cache = model.run_with_cache(
        TEXTS, names_filter=[f"{rotary}.input.0", f"{rotary}.input.1", "blocks.1.attn.hook_q"]
    )
    for i in range(len(TEXTS)):
        q = cache.unpadded("blocks.1.attn.hook_q", i)
        assert torch.equal(cache.unpadded(f"{rotary}.input.1", i), q.flatten(1))
        positions = cache.unpadded(f"{rotary}.input.0", i)
        assert torch.equal(positions, torch.arange(len(positions)))


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("model.layers.1.self_attn.source.qkv_splt_0.output", "Did you mean: qkv_split_0"),
        ("model.layers.1.self_attn.source.qkv_split_0.inputs", "name one"),
        ("model.layers.1.self_attn.rotary_emb.source.x_0.output", "shared by 3 places"),
        ("model.layers.1.self_attn.source.self_attn_0.input.nothing", "no keyword argument"),
    ],
)
def test_operations_that_cannot_be_read(hooked, name, message):
    with pytest.raises(Exception, match=message):
        hooked("llama").run_with_cache("x", names_filter=name)


def test_an_operation_a_layer_never_runs_is_refused_with_the_reason(hooked):
    """Cohere 2's full layers list the rotary operation in their forward but never run it."""
    model = hooked("cohere2")
    full = model.checkpoint.hf_config.layer_types.index("full_attention")
    rotary = f"{attention_path(model, full)}.source.self_rotary_emb_0.output.0"
    with pytest.raises(RuntimeError, match="never ran for this request.*a layer that runs it"):
        model.run_with_cache(TEXTS, names_filter=[rotary])
