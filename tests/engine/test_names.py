"""Hook names as users type them: canonical, TransformerLens short forms and bridge aliases."""

import pytest
import torch

from vlens.names.resolve import UnknownHookName, canonical, select

NAMES = ["hook_embed", "blocks.0.hook_resid_pre", "blocks.0.hook_resid_post",
         "blocks.1.hook_resid_post", "unembed.hook_out"]


def test_unknown_name_lists_near_matches():
    with pytest.raises(UnknownHookName) as error:
        canonical("blocks.0.hook_resid_psot", NAMES)
    assert "blocks.0.hook_resid_post" in str(error.value)
    assert "Did you mean" in str(error.value)


def test_bridge_aliases():
    assert canonical("blocks.1.hook_out", NAMES) == "blocks.1.hook_resid_post"
    assert canonical("blocks.0.hook_in", NAMES) == "blocks.0.hook_resid_pre"
    assert canonical("embed.hook_out", NAMES) == "hook_embed"
    assert canonical("logits", NAMES) == "unembed.hook_out"


def test_names_filter_forms():
    assert select(None, NAMES) == NAMES
    assert select("blocks.1.hook_out", NAMES) == ["blocks.1.hook_resid_post"]
    assert select(["unembed.hook_out", "hook_embed"], NAMES) == ["hook_embed", "unembed.hook_out"]
    assert select(lambda n: n.endswith("resid_post"), NAMES) == NAMES[2:4]
    with pytest.raises(ValueError, match="none"):
        select(lambda n: False, NAMES)
    with pytest.raises(UnknownHookName):
        select(["hook_embed", "hook_pos_embed"], NAMES)


def test_cache_indexing(hooked):
    model = hooked("llama")
    _, cache = model.run_with_cache("Index me", names_filter=lambda n: "resid" in n)
    last = model.cfg.n_layers - 1
    full = cache[f"blocks.{last}.hook_resid_post"]
    assert torch.equal(cache["resid_post", last], full)
    assert torch.equal(cache["resid_post", -1], full)
    assert torch.equal(cache[f"blocks.{last}.hook_out"], full)
    with pytest.raises(KeyError, match="hook_resid_mid"):
        cache["blocks.0.hook_resid_mdi"]
    with pytest.raises(KeyError, match="not a hook name of this cache"):
        cache["hook_embed"]


def test_run_with_cache_unknown_name_fails_before_running(hooked):
    model = hooked("llama")
    with pytest.raises(UnknownHookName, match="blocks.0.hook_resid_pre"):
        model.run_with_cache("x", names_filter="blocks.0.hook_resid_pree")


def test_engine_arguments_vlens_cannot_honour():
    from vlens.engine.arguments import engine_args

    with pytest.raises(ValueError, match="eager"):
        engine_args({"enforce_eager": False})
    assert engine_args({"enable_prefix_caching": False})["enable_prefix_caching"] is False
    with pytest.raises(ValueError, match="worker_extension_cls"):
        engine_args({"worker_extension_cls": "my.Extension"})
    assert engine_args({"dtype": "float32"})["enforce_eager"] is True


def test_model_prints_vllm_tree(hooked):
    text = repr(hooked("qwen3"))
    assert "Qwen3ForCausalLM" in text and "qkv_proj" in text and "post_attention_layernorm" in text
