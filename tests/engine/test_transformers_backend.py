"""Architectures vLLM runs through its Transformers backend (``mappings/_transformers.py``):
names from TransformerLens's adapters, reads and edits on HuggingFace's modules (a batch of one),
HuggingFace beside the engine in one process. Parity itself is tests/engine/test_parity.py's."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

import vlens.engine.checkpoint as checkpoint_module
from vlens.hooked.model import HookedVLLM
from vlens.mappings import served
from vlens.mappings._transformers import Details, layout_of, transformers_backend_mapping
from vlens.mappings.olmo3 import TINY_WINDOW
from vlens.parity.compare import FP32_MAX_REL, PROMPTS
from vlens.parity.run import run_parity
from vlens.testing.tiny import tiny_model

TEXTS = ["The river ran past the old mill", "Hello world"]
KV_CACHE = {"kv_cache_memory_bytes": 64 * 2**20}  # as the session's tiny engines


def test_layouts_come_from_transformer_lens_adapters():
    neox = layout_of(AutoConfig.from_pretrained(tiny_model("gpt_neox")))
    assert (neox.base, neox.qkv, neox.o) == ("gpt_neox", "query_key_value", "dense")
    assert neox.parallel
    olmo2 = layout_of(AutoConfig.from_pretrained(tiny_model("olmo2")))
    assert (olmo2.ln1, olmo2.ln2) == (None, None)
    assert olmo2.ln1_post == "post_attention_layernorm"
    assert olmo2.ln2_post == "post_feedforward_layernorm"
    assert (olmo2.q_norm, olmo2.mlp_gate) == ("q_norm", "gate_proj")
    phi = layout_of(AutoConfig.from_pretrained(tiny_model("phi")))
    assert (phi.ln1, phi.ln2, phi.parallel) == ("input_layernorm", None, True)


def test_zeroed_values_reach_z_in_every_request(hooked):
    """An edit of hook_v (per-head parts of GPT-NeoX's interleaved qkv, on a batch of one) lands
    in the model for each request of a mixed batch: z, a weighted sum of v, becomes zero."""
    model = hooked("gpt_neox")

    def zero(v, hook):
        return torch.zeros_like(v)

    with model.hooks(fwd_hooks=[("blocks.1.attn.hook_v", zero)]):
        _, cache = model.run_with_cache(TEXTS, names_filter=["blocks.1.attn.hook_z"])
    for i in range(len(TEXTS)):
        z = cache.unpadded("blocks.1.attn.hook_z", i)
        assert z.abs().max() == 0
    _, clean = model.run_with_cache(TEXTS, names_filter=["blocks.1.attn.hook_z"])
    assert clean.unpadded("blocks.1.attn.hook_z", 1).abs().max() > 0


def test_hooks_on_scores_say_why_they_cannot_run(hooked):
    model = hooked("olmo2")
    with pytest.raises(Exception, match="Transformers backend"):
        model.add_hook("blocks.0.attn.hook_pattern", lambda pattern, hook: pattern)


BESIDE_AN_ENGINE = """
import json, os, sys
import torch
from transformers import AutoModelForCausalLM
from vlens import HookedVLLM

path, tokens = sys.argv[1], torch.tensor([json.loads(sys.argv[2])])
def logits_of(model):
    with torch.no_grad():
        return model(tokens).logits[0]
def hf():
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
before = hf()
first = logits_of(before)
engine = HookedVLLM.from_pretrained(path, dtype="float32", **json.loads(sys.argv[3]))
ours = engine(tokens)[0].float()
again = logits_of(before)
after = logits_of(hf())
torch.save({"first": first, "again": again, "after": after, "ours": ours}, sys.argv[4])
"""


def test_huggingface_models_built_before_and_after_an_engine_work_as_before(tmp_path, engine_args):
    """vLLM's Transformers backend rewrites HuggingFace's ``GPTNeoXModel`` class for its compiler
    while it builds an engine; vlens gives the class back as it was, so a HuggingFace model built
    before the engine still runs, one built after builds, and both compute what they did (a fresh
    process: no engine of this architecture has run before it)."""
    import json
    import subprocess
    import sys

    path = tiny_model("gpt_neox")
    out = tmp_path / "logits.pt"
    tokens = [0, 17, 42, 99, 5, 300]
    result = subprocess.run(
        [sys.executable, "-c", BESIDE_AN_ENGINE, str(path), json.dumps(tokens),
         json.dumps(engine_args), str(out)],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    logits = torch.load(out)
    assert torch.equal(logits["again"], logits["first"])
    assert torch.equal(logits["after"], logits["first"])
    torch.testing.assert_close(logits["ours"], logits["first"], rtol=1e-4, atol=1e-4)


def test_llama_forced_onto_the_backend_is_read_by_the_generic_mapping(monkeypatch):
    """``model_impl="transformers"`` builds HuggingFace's Llama inside vLLM; the mapping derived
    from TransformerLens's Llama adapter reads every name of it as HuggingFace and the bridge
    compute them (vlens chooses mappings by architecture alone, hence the patch). The mapping,
    not the user, asks for the backend."""
    generic = transformers_backend_mapping("LlamaForCausalLM", details=Details(eps="rms_norm_eps"))
    monkeypatch.setattr(checkpoint_module, "mapping_for", lambda config: generic)
    path = tiny_model("llama")
    model = HookedVLLM.from_pretrained(path, dtype="float32", **KV_CACHE)
    assert str(model.engine.llm.llm_engine.model_config.model_impl) in {
        "transformers",
        "ModelImpl.TRANSFORMERS",
    }
    rows, uncovered = run_parity(model, path)
    assert not uncovered
    assert {row.reference for row in rows} == {"HuggingFace", "TransformerLens"}
    failures = [row for row in rows if not row.within(FP32_MAX_REL)]
    assert not failures, failures


def test_windowed_olmo3_offers_no_scores_and_its_parity_prompts_pass_the_window(hooked):
    path = tiny_model("olmo3")
    mapping = served()["Olmo3ForCausalLM"]
    specs = mapping.expanded(AutoConfig.from_pretrained(path))
    assert "blocks.0.attn.hook_z" in specs and "blocks.0.attn.hook_pattern" not in specs
    assert "sliding window" in mapping.unavailable("blocks.0.attn.hook_pattern")
    lengths = [len(tokens) for tokens in hooked("olmo3").token_lists(list(PROMPTS))]
    assert max(lengths) > 2 * TINY_WINDOW


@pytest.mark.parametrize(
    ("arch", "model_impl", "message"),
    [
        ("gpt_neox", "vllm", "names the modules of vLLM's Transformers backend"),
        ("gpt_neox", "auto", "leave model_impl out"),
        ("llama", "transformers", "names the modules of vLLM's own implementation"),
    ],
)
def test_a_model_impl_building_another_tree_is_refused_before_loading(arch, model_impl, message):
    """A backend whose module tree the mapping does not name would leave every name unreadable;
    the refusal comes before vLLM starts (no engine is built here)."""
    with pytest.raises(ValueError, match=message):
        HookedVLLM.from_pretrained(tiny_model(arch), model_impl=model_impl)
