"""HookedTransformer's calling conventions, checked against TransformerLens's own bridge on the
same checkpoint: ``model(...)`` and its return types, losses, ``stop_at_layer``,
``remove_batch_dim``, bridge hook spellings, ``generate``'s arguments, and what vLLM cannot do."""

from __future__ import annotations

import pytest
import torch

from vlens import HookedVLLM

TEXT = "The cat sat on the mat"
TEXTS = ["The cat sat on the mat", "A dog ran"]
# fp32 on the CPU: vLLM's kernels and HuggingFace's sum in other orders.
CLOSE = {"rtol": 1e-4, "atol": 1e-4}


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def models(request, hooked, bridge) -> tuple[HookedVLLM, object]:
    return hooked(request.param), bridge(request.param)


def test_calling_the_model_returns_transformer_lens_logits(models):
    model, bridge = models
    torch.testing.assert_close(model(TEXT), bridge(TEXT), **CLOSE)
    torch.testing.assert_close(model.forward(TEXT, return_type="logits"), bridge(TEXT), **CLOSE)
    assert model(TEXT, return_type=None) is None


@pytest.mark.parametrize("per_token", [False, True])
def test_loss_equals_transformer_lens_loss(models, per_token):
    model, bridge = models
    ours = model(TEXT, return_type="loss", loss_per_token=per_token)
    theirs = bridge(TEXT, return_type="loss", loss_per_token=per_token)
    assert ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs, **CLOSE)
    logits, loss = model(TEXT, return_type="both")
    torch.testing.assert_close(loss, bridge(TEXT, return_type="loss"), **CLOSE)
    assert logits.shape[:2] == model.to_tokens(TEXT).shape


def test_loss_of_a_padded_batch_counts_real_positions_only(models):
    """TransformerLens predicts right-padding pad tokens too; vlens never runs padding, and its
    loss is TransformerLens's over the real positions of each prompt."""
    model, bridge = models
    per_prompt = [bridge(text, return_type="loss", loss_per_token=True)[0] for text in TEXTS]
    expected = torch.cat(per_prompt).mean()
    torch.testing.assert_close(model(TEXTS, return_type="loss"), expected, **CLOSE)


@pytest.mark.parametrize("stop", [0, 1, -1, 2])
def test_stop_at_layer_returns_the_residual_stream_there(models, stop):
    model, bridge = models
    torch.testing.assert_close(
        model(TEXT, stop_at_layer=stop), bridge(TEXT, stop_at_layer=stop), **CLOSE
    )
    _, cache = model.run_with_cache(TEXT, stop_at_layer=stop)
    layer = stop % model.cfg.n_layers if stop < 0 else stop
    assert all(not name.startswith(f"blocks.{layer}.") for name in cache.keys())


def test_out_of_range_stop_at_layer_is_refused(models):
    model, _ = models
    with pytest.raises(ValueError, match="stop_at_layer"):
        model(TEXT, stop_at_layer=model.cfg.n_layers + 1)


def test_run_with_cache_removes_the_batch_dimension(models):
    model, bridge = models
    _, cache = model.run_with_cache(TEXT, remove_batch_dim=True)
    _, theirs = bridge.run_with_cache(TEXT, remove_batch_dim=True)
    name = "blocks.1.hook_resid_post"
    assert cache[name].shape == theirs[name].shape
    torch.testing.assert_close(cache[name], theirs[name], **CLOSE)
    _, as_dict = model.run_with_cache(TEXT, names_filter=name, return_cache_object=False)
    assert isinstance(as_dict, dict) and list(as_dict) == [name]


def test_bridge_spellings_name_the_same_values(models):
    """TransformerLens 4's own names (``attn.o.hook_in`` = ``attn.hook_z``, ...)."""
    model, bridge = models
    spellings = {
        "blocks.1.attn.o.hook_in": "blocks.1.attn.hook_z",
        "blocks.1.attn.q.hook_out": "blocks.1.attn.hook_q",
        "blocks.1.mlp.out.hook_in": "blocks.1.mlp.hook_post",
        "blocks.1.ln1.hook_in": "blocks.1.hook_resid_pre",
        "blocks.1.ln2.hook_in": "blocks.1.hook_resid_mid",
        "hook_unembed": "unembed.hook_out",
    }
    _, cache = model.run_with_cache(TEXT, names_filter=list(spellings))
    _, theirs = bridge.run_with_cache(TEXT)
    for spelling, name in spellings.items():
        assert spelling in cache and name in cache
        torch.testing.assert_close(cache[spelling], theirs[name], **CLOSE, msg=spelling)


def test_hooks_by_bridge_spelling_edit_the_model(models):
    model, bridge = models

    def zero_head_0(z, hook):
        z[:, :, 0] = 0

    ours = model.run_with_hooks(TEXT, fwd_hooks=[("blocks.0.attn.o.hook_in", zero_head_0)])
    theirs = bridge.run_with_hooks(TEXT, fwd_hooks=[("blocks.0.attn.hook_z", zero_head_0)])
    torch.testing.assert_close(ours, theirs, **CLOSE)
    assert not torch.allclose(ours, model(TEXT), **CLOSE)


def test_generate_takes_transformer_lens_arguments(models):
    model, _ = models
    plain = model.generate(TEXT, max_new_tokens=4, do_sample=False)
    assert isinstance(plain, str) and plain.startswith(TEXT)
    same = model.generate(
        TEXT, max_new_tokens=4, do_sample=False, verbose=False, use_past_kv_cache=False,
        top_p=None, top_k=None, freq_penalty=0.0,
    )
    assert same == plain
    tokens = model.generate(TEXT, max_new_tokens=4, do_sample=False, return_type="tokens")
    assert isinstance(tokens, torch.Tensor) and tokens.shape == (1, model.to_tokens(TEXT).shape[1] + 4)
    stop = int(tokens[0, model.to_tokens(TEXT).shape[1]])  # the first generated token
    stopped = model.generate(
        TEXT, max_new_tokens=4, do_sample=False, eos_token_id=stop, return_type="tokens"
    )
    assert stopped[0][-1] == stop and len(stopped[0]) == model.to_tokens(TEXT).shape[1] + 1


def test_generate_returns_transformer_lens_s_token_batch(models):
    """A tensor in, TransformerLens's ``[batch, pos]`` tensor of prompt and new tokens out."""
    model, bridge = models
    tokens = model.to_tokens(TEXT).repeat(2, 1)
    tokens[1, 1:] = tokens[1, 1:].flip(0)  # two prompts of one length: no padding to differ on
    ours = model.generate(tokens, max_new_tokens=3, do_sample=False, stop_at_eos=False)
    with torch.no_grad():
        theirs = bridge.generate(tokens, max_new_tokens=3, do_sample=False, stop_at_eos=False,
                                 verbose=False)
    assert isinstance(ours, torch.Tensor) and ours.shape == (2, tokens.shape[1] + 3)
    assert torch.equal(ours, theirs.cpu())


def test_transformer_lens_settings_are_accepted(models):
    model, _ = models
    model.set_use_attn_result(True)
    model.set_use_split_qkv_input(True)
    model.set_use_hook_mlp_in(True)
    with pytest.raises(ValueError, match="mutually exclusive.*set_use_split_qkv_input\\(False\\)"):
        model.set_use_attn_in(True)
    model.set_use_split_qkv_input(False)
    model.set_use_attn_in(True)
    try:
        _, cache = model.run_with_cache(TEXT, names_filter=lambda name: "blocks.0.attn.hook_result" == name)
        assert cache["blocks.0.attn.hook_result"].shape[-2:] == (model.cfg.n_heads, model.cfg.d_model)
    finally:  # the model is shared by the session's tests: leave its settings as found
        model.set_use_attn_in(False)
        model.set_use_attn_result(False)
        model.set_use_hook_mlp_in(False)


@pytest.mark.parametrize("call", [lambda m: m.train(), lambda m: m.requires_grad_(True)])
def test_training_is_refused_with_where_gradients_run(models, call):
    model, _ = models
    with pytest.raises(NotImplementedError, match="inference only.*gradient twin"):
        call(model)


def test_module_calls_of_notebooks_return_the_model_as_on_the_bridge(models):
    """``model.eval()``, ``model.to(device)`` and kin where they already hold (the engine's
    device and dtype; an engine is never training) return the model, as ``nn.Module`` does."""
    model, bridge = models
    assert bridge.eval() is bridge and not bridge.training
    assert model.eval() is model and not model.training and model.train(False) is model
    here = model.engine_device_type()  # "cpu" here, "cuda" on a GPU
    assert model.to(here) is model and getattr(model, here)() is model
    assert model.to(torch.device(here)) is model and model.to(torch.float32) is model
    assert model.requires_grad_(False) is model
    torch.testing.assert_close(model(TEXT), bridge(TEXT), **CLOSE)


def test_module_calls_vllm_cannot_follow_are_refused_with_the_fix(models):
    model, _ = models
    with pytest.raises(ValueError, match=r"weights are torch.float32.*from_pretrained\(path, dtype='float16'\)"):
        model.to(torch.float16)
    here = model.engine_device_type()
    with pytest.raises(ValueError, match=f"runs on {here!r}.*tensor.to"):
        model.cpu() if here == "cuda" else model.cuda()
    with pytest.raises(ValueError, match=f"runs on {here!r}"):
        model.to("meta")
    with pytest.raises(NotImplementedError, match="train\\(\\): vLLM runs inference only"):
        model.train()
    with pytest.raises(NotImplementedError, match="inference only"):
        model.requires_grad_()


def test_the_bridges_hugging_face_model_is_refused_with_how_to_load_one(models):
    model, bridge = models
    assert bridge.original_model is not None
    with pytest.raises(AttributeError, match="holds no HuggingFace module.*AutoModelForCausalLM"):
        model.original_model  # noqa: B018 - the attribute access is the test


def test_what_vllm_cannot_start_from_is_refused(models):
    model, _ = models
    with pytest.raises(NotImplementedError, match="hook_resid_pre"):
        model(TEXT, start_at_layer=1)
    with pytest.raises(ValueError, match="freq_penalty.*at most 2"):
        model.generate(TEXT, max_new_tokens=2, freq_penalty=3.0)
    with pytest.raises(ValueError, match="return_type"):
        model(TEXT, return_type="bogus")


def test_a_name_filter_passes_over_names_that_cannot_carry_hooks(models):
    """As TransformerLens's filters run over its hook points (Main_Demo cell 25): a filter that
    accepts every name outside the blocks hooks those that can carry a hook."""
    model, _ = models
    seen: list[str] = []
    model.run_with_hooks(
        TEXT,
        return_type=None,
        fwd_hooks=[(lambda name: not name.startswith("blocks"), lambda x, hook: seen.append(hook.name))],
    )
    assert "hook_embed" in seen
    assert "sampler.hook_tokens" not in seen
    with pytest.raises(ValueError, match="sampler.hook_tokens cannot carry a hook"):
        model.run_with_hooks(TEXT, fwd_hooks=[(lambda name: name == "sampler.hook_tokens", print)])


def test_a_filter_that_accepts_no_name_adds_nothing_and_says_so(models):
    """TransformerLens adds no hook where its filter accepts no hook point; vlens does the same
    and warns with the filter's name; a name or pattern that matches nothing stays an error."""
    model, _ = models
    nowhere = lambda name: name.endswith("hook_nowhere")  # noqa: E731
    with pytest.warns(UserWarning, match="accepts none"):
        model.add_hook(nowhere, lambda x, hook: x * 0)
    assert not model.registry.added
    with pytest.raises(KeyError):
        model.add_hook("blocks.0.hook_nowhere", print)


def test_freq_penalty_is_transformer_lens_s(models):
    """TransformerLens samples from ``logits / T - freq_penalty · count`` (prompt and generated
    tokens counted): with ``top_k=1`` that is a deterministic argmax, computed here from the
    engine's own logits token by token."""
    model, _ = models
    prompt = model.to_tokens(TEXT)[0].tolist()
    penalty, temperature, new = 1.5, 1.2, 8
    expected = list(prompt)
    for _ in range(new):
        logits = model(torch.tensor([expected]))[0, -1]
        counts = torch.bincount(torch.tensor(expected), minlength=logits.shape[-1])
        expected.append(int((logits / temperature - penalty * counts).argmax()))
    sampled = model.generate(torch.tensor([prompt]), max_new_tokens=new, top_k=1,
                             temperature=temperature, freq_penalty=penalty, stop_at_eos=False,
                             return_type="tokens")
    greedy = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False,
                            freq_penalty=penalty, stop_at_eos=False, return_type="tokens")
    assert sampled[0].tolist() == expected
    assert greedy[0].tolist() != expected, "the penalty changed nothing on this prompt"
