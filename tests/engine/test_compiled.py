"""The compiled engine on vLLM's CPU compile mode: the same caches and steered tokens as eager mode,
steering confined to its request, and clear refusals of what a traced graph cannot do."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from vlens import HookedVLLM
from vlens.engine.arguments import check_loadable
from vlens.mappings import served
from vlens.runtime.vocabulary.steering import Steer
from vlens.testing.tiny import sweep, tiny_archs, tiny_configs, tiny_model

CAPTURED = (
    "hook_embed",
    "blocks.0.hook_resid_pre",
    "blocks.0.ln1.hook_scale",
    "blocks.0.attn.hook_z",
    "blocks.1.attn.hook_pattern",  # derived: declares hook_rot_q and hook_rot_k
    "blocks.1.mlp.hook_post",
    "blocks.1.hook_resid_post",
    "unembed.hook_out",
)
STEERED = ("blocks.0.hook_resid_pre", "blocks.0.attn.hook_z", "blocks.1.hook_resid_post")
PROMPTS = [[5, 17, 42, 99, 3, 250, 7], [11, 12, 13], [300, 301, 302, 303, 304]]
# fp32 on both sides; Inductor fuses and reorders the traced hooks' arithmetic (observed ≤ 1e-6).
TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}
#: Where a name's elements miss :data:`TOLERANCE`, each vector along its last axis (a token's, or
#: one head's of a token) must still be within this of eager's, relative to its norm (the parity
#: suite's relative measure over vectors no larger than its tokens', ten times tighter than its
#: fp32 bound). Why: a reordered sum is exact to ~1e-7 of the vector it belongs to, not of each
#: element; relu² (Nemotron) squares a pre-activation whose reordering error is 1e-6 of the
#: layer's scale, which near zero is 6.5e-5 absolute on its tiny checkpoint, 2.2e-6 per token.
PER_TOKEN = 1e-5


@pytest.fixture(scope="module")
def compiled(hooked) -> HookedVLLM:
    return hooked("llama", compiled_capture=CAPTURED, compiled_steering=STEERED)


@pytest.fixture(scope="module")
def eager(hooked) -> HookedVLLM:
    return hooked("llama", enforce_eager=True)


def steering_vector(model: HookedVLLM, seed: int) -> torch.Tensor:
    return torch.randn(model.cfg.d_model, generator=torch.Generator().manual_seed(seed))


def test_compiled_cache_equals_eager_prefill_and_decode(compiled, eager):
    names = [name for name in CAPTURED if name != "unembed.hook_out"] + ["blocks.1.attn.hook_rot_q"]
    logits_c, cache_c = compiled.run_with_cache(PROMPTS, names_filter=names, max_new_tokens=4)
    logits_e, cache_e = eager.run_with_cache(PROMPTS, names_filter=names, max_new_tokens=4)
    assert torch.equal(cache_c.lengths, cache_e.lengths)
    assert torch.equal(cache_c.tokens, cache_e.tokens)
    for name in names:
        torch.testing.assert_close(cache_c[name], cache_e[name], **TOLERANCE, msg=name)
    torch.testing.assert_close(logits_c, logits_e, **TOLERANCE)


def test_compiled_engine_serves_its_declared_names_by_default(compiled):
    _, cache = compiled.run_with_cache(PROMPTS[:1], return_type=None)
    assert "blocks.1.attn.hook_pattern" in cache and "blocks.1.attn.hook_rot_k" in cache
    assert "blocks.0.hook_resid_post" not in cache
    assert "sampler.hook_tokens" in cache  # read outside the graph: always there


def test_logits_come_back_from_an_engine_that_declared_one_name(hooked, eager):
    """The final norm's rows are traced into every compiled graph: logits without declaring
    ``unembed.hook_out``, and the cache holds only what was declared."""
    one = "blocks.1.hook_resid_post"
    compiled = hooked("llama", compiled_capture=(one,))
    logits, cache = compiled.run_with_cache(PROMPTS, max_new_tokens=2)
    eager_logits, eager_cache = eager.run_with_cache(PROMPTS, names_filter=[one], max_new_tokens=2)
    torch.testing.assert_close(logits, eager_logits, **TOLERANCE)
    torch.testing.assert_close(cache[one], eager_cache[one], **TOLERANCE)
    assert [name for name in cache.keys() if not name.startswith("sampler.")] == [one]
    torch.testing.assert_close(compiled(PROMPTS), eager(PROMPTS), **TOLERANCE)


def test_compiled_steering_equals_eager_steering(compiled, eager):
    steer = [
        Steer("blocks.1.hook_resid_post", add=steering_vector(eager, 0), scale=6.0,
              positions=slice(2, None)),
        Steer("blocks.0.hook_resid_pre", ablate=steering_vector(eager, 1), gain=1.5,
              positions=[0, 3, 8]),
    ]
    per_prompt = [steer, [], []]
    tokens = {
        engine: model.generate(PROMPTS, max_new_tokens=8, do_sample=False, stop_at_eos=False,
                               prompt_steering=per_prompt, return_type="result")
        for engine, model in (("compiled", compiled), ("eager", eager))
    }
    plain = eager.generate(PROMPTS, max_new_tokens=8, do_sample=False, stop_at_eos=False,
                           return_type="result")
    assert tokens["compiled"] == tokens["eager"]
    assert tokens["compiled"][0] != plain[0], "the steer should change the steered prompt"
    assert tokens["compiled"][1:] == plain[1:]

    _, cache_c = compiled.run_with_cache(PROMPTS, names_filter=list(STEERED[::2]),
                                         max_new_tokens=3, prompt_steering=per_prompt)
    _, cache_e = eager.run_with_cache(PROMPTS, names_filter=list(STEERED[::2]),
                                      max_new_tokens=3, prompt_steering=per_prompt)
    for name in STEERED[::2]:
        torch.testing.assert_close(cache_c[name], cache_e[name], **TOLERANCE, msg=name)


def test_unsteered_requests_are_untouched_bit_for_bit(compiled):
    names = ["blocks.1.hook_resid_post", "unembed.hook_out"]
    steer = Steer("blocks.0.attn.hook_z", add=torch.ones(compiled.cfg.d_model) * 3)
    _, steered = compiled.run_with_cache(PROMPTS, names_filter=names, max_new_tokens=3,
                                         prompt_steering=[[], [steer], []])
    _, plain = compiled.run_with_cache(PROMPTS, names_filter=names, max_new_tokens=3)
    for name in names:
        assert torch.equal(steered[name][0], plain[name][0]), name
        assert torch.equal(steered[name][2], plain[name][2]), name
        assert not torch.equal(steered[name][1], plain[name][1]), name


def test_steering_only_at_the_chosen_positions(compiled):
    vector = steering_vector(compiled, 2)
    name = "blocks.0.hook_resid_pre"
    _, plain = compiled.run_with_cache(PROMPTS[:1], names_filter=[name], return_type=None)
    _, steered = compiled.run_with_cache(PROMPTS[:1], names_filter=[name], return_type=None,
                                         steering=[Steer(name, add=vector, positions=[1, 4])])
    difference = steered[name][0] - plain[name][0]
    assert torch.equal(difference[[0, 2, 3, 5, 6]], torch.zeros(5, compiled.cfg.d_model))
    torch.testing.assert_close(difference[[1, 4]], vector.expand(2, -1), **TOLERANCE)


def test_python_hooks_on_traced_names_are_refused_with_the_alternatives(compiled):
    with pytest.raises(ValueError, match=r"Steer\(.*compiled_steering.*eager"):
        compiled.add_hook("blocks.1.hook_resid_post", lambda x, hook: x)
    with pytest.raises(ValueError, match="cannot run on this compiled engine"):
        compiled.generate(PROMPTS, max_new_tokens=2, fwd_hooks=[("hook_embed", lambda x, h: x)])
    with pytest.raises(ValueError, match="cannot run on this compiled engine"):
        compiled.run_with_hooks(PROMPTS, fwd_hooks=[("blocks.0.hook_resid_post", lambda x, h: x)])
    assert compiled.registry.added == []


def test_undeclared_names_are_refused_with_the_fix(compiled):
    with pytest.raises(ValueError, match=r"blocks\.0\.hook_resid_post not traced.*compiled_capture"):
        compiled.run_with_cache(PROMPTS, names_filter=["blocks.0.hook_resid_post"])
    with pytest.raises(ValueError, match="compiled_steering"):
        compiled.generate(PROMPTS, steering=[Steer("blocks.0.hook_mlp_out", add=torch.ones(64))])
    with pytest.raises(ValueError, match="raw module locations"):
        compiled.run_with_cache(PROMPTS, names_filter=["model.layers.0.mlp.output"])
    with pytest.raises(ValueError, match="has 3 elements"):
        compiled.generate(PROMPTS, steering=[Steer("blocks.0.hook_resid_pre", add=torch.ones(3))])


def test_sampler_names_and_hooks_still_work_outside_the_graph(compiled):
    banned = 7

    def ban(logits, hook):
        logits[..., banned] = -float("inf")

    tokens = compiled.generate(PROMPTS, max_new_tokens=5, do_sample=False, stop_at_eos=False,
                               fwd_hooks=[("sampler.hook_logits", ban)], return_type="result")
    assert all(banned not in generation.tokens for generation in tokens)


#: Every compiled architecture under ``VLENS_TEST_EVERY_ARCH=1``; else one per way of tracing.
TRACED = {
    "llama": "fused residual, qkv_proj, gated MLP",
    "gpt2": "Conv1D projections, a plain residual, LayerNorm",
    "gemma3": "scaled embedding, per-head q/k norms, norms around each sublayer, sliding windows",
    "qwen3_moe": "a mixture of experts through vLLM's moe_forward op",
    "deepseek_v2": "multi-head latent attention, shared experts",
    "bloom": "ALiBi, a fused qkv interleaved per head",
    "cohere": "a parallel block, the logit scale",
    "gpt_oss": "attention sinks, alternating sliding windows, biased experts",
    "nemotron": "a relu² MLP, held vector by vector where it squares values near zero",
    "olmo2": "HuggingFace's own modules, through vLLM's Transformers backend",
}


@pytest.mark.parametrize("arch", sweep(tiny_archs(lambda mapping: mapping.compiled_graph), TRACED))
def test_every_name_reads_the_same_traced_as_eager(hooked, arch):
    if torch.cuda.is_available() and getattr(tiny_configs()[arch](), "kv_lora_rank", None):
        pytest.skip("vLLM has no fp32 MLA attention on CUDA: tools/gpu/gpu_deepseek.sh runs "
                    "DeepSeek in bf16")
    eager = hooked(arch, enforce_eager=True)
    names = tuple(name for name in eager.hook_names if not name.startswith("sampler."))
    compiled = hooked(arch, compiled_capture=names)
    _, cache_c = compiled.run_with_cache(PROMPTS, max_new_tokens=3)
    _, cache_e = eager.run_with_cache(PROMPTS, names_filter=list(cache_c.keys()), max_new_tokens=3)
    assert set(cache_c.keys()) >= set(names)
    for name in names:
        assert_traced_equal(cache_c[name], cache_e[name], name)


def test_a_compiled_transformers_backend_engine_runs_its_graph_and_leaves_the_process_as_it_was(
    hooked,
):
    """vLLM's Transformers backend compiles HuggingFace's own decoder class, which it rewrites in
    place. The engine runs vLLM's compiled code (HuggingFace's layers run no Python), the class
    is HuggingFace's own again (a HuggingFace model of it builds and runs beside the engine),
    and a later compile in the process works (vLLM's compiler hook left registered for the
    engine's model is called at each)."""
    eager = hooked("olmo2", enforce_eager=True)
    names = tuple(name for name in eager.hook_names if not name.startswith("sampler."))
    compiled = hooked("olmo2", compiled_capture=names)  # the sweep's engine
    runner = compiled.engine.llm.llm_engine.model_executor.driver_worker.worker.model_runner
    decoder = runner.model.model
    layer_code = type(decoder.layers[0]).forward.__code__
    calls: list[int] = []

    def count(frame, event: str, argument) -> None:
        if event == "call" and frame.f_code is layer_code:
            calls.append(1)

    sys.setprofile(count)
    try:
        compiled.generate(PROMPTS[:1], max_new_tokens=2, do_sample=False)
    finally:
        sys.setprofile(None)
    assert calls == []
    assert "TorchCompileWithNoGuardsWrapper" not in {base.__name__ for base in
                                                     type(decoder).__mro__[1].__mro__}
    reference = AutoModelForCausalLM.from_pretrained(tiny_model("olmo2"), dtype=torch.float32)
    assert type(reference.model) is type(decoder).__mro__[1]
    assert torch.isfinite(reference(torch.tensor([PROMPTS[0]])).logits).all()
    assert torch.compile(lambda x: x * 2, backend="eager")(torch.ones(2)).tolist() == [2.0, 2.0]


def assert_traced_equal(traced: torch.Tensor, eager: torch.Tensor, name: str) -> None:
    """Element by element within :data:`TOLERANCE`, else vector by vector along the last axis
    within :data:`PER_TOKEN` of each eager vector's norm. Entries that are not finite (masked
    scores, ``-inf``) must be equal and count as no error."""
    if torch.allclose(traced, eager, **TOLERANCE):
        return
    assert traced.shape == eager.shape, name
    same = traced == eager
    finite = torch.isfinite(eager)
    assert same[~finite].all(), f"{name}: traced differs from eager where eager is not finite"
    difference = torch.where(same, 0.0, traced - eager)
    error = difference.norm(dim=-1) / torch.where(finite, eager, 0.0).norm(dim=-1).clamp_min(1e-30)
    worst = error.max().item()
    assert worst <= PER_TOKEN, f"{name}: a traced vector is {worst:.2e} from eager's"


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"enforce_eager": True}, "enforce_eager=True is not supported"),
        ({"worker_cls": "my.Worker"}, "worker_cls is not supported on a compiled engine"),
    ],
)
def test_engine_arguments_a_compiled_engine_cannot_honour(arguments, message):
    with pytest.raises((ValueError, NotImplementedError), match=message):
        HookedVLLM.from_pretrained(tiny_model("llama"), compiled_capture=["hook_embed"], **arguments)


def test_unverified_architectures_refuse_compiled_names():
    """A mapping that does not offer the compiled engine: refused before vLLM starts, with the
    reason and the way out."""
    mapping = dataclasses.replace(served()["LlamaForCausalLM"], compiled_graph=False)
    with pytest.raises(NotImplementedError, match="not offered for LlamaForCausalLM: its names "
                       "are not yet checked .* without compiled_capture"):
        check_loadable(mapping, "LlamaForCausalLM", {}, compiled=True)


def test_names_read_after_the_forward_need_no_declaration():
    with pytest.raises(ValueError, match="needs no declaration"):
        HookedVLLM.from_pretrained(tiny_model("llama"), compiled_capture=["sampler.hook_logits"])


def test_the_cache_and_logits_are_moved_to_the_device_asked_for(compiled):
    """The engine computes on the CPU here; "meta" is a device every machine has, so values found
    there were moved by the ``device`` argument, derived names (the pattern) included."""
    names = ["blocks.1.hook_resid_post", "blocks.1.attn.hook_pattern"]
    logits, cache = compiled.run_with_cache(PROMPTS, names_filter=names, device="meta",
                                            max_new_tokens=2)
    logits_cpu, on_cpu = compiled.run_with_cache(PROMPTS, names_filter=names, max_new_tokens=2)
    assert logits.device.type == "meta" and logits.shape == logits_cpu.shape
    for name in names:
        assert cache[name].device.type == "meta", name
        assert cache[name].shape == on_cpu[name].shape, name


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_an_unavailable_device_is_refused_and_the_engine_keeps_serving(compiled):
    """Asking for CUDA where there is none fails the call with an error that names it, and the
    next call returns the same values as before: the failed hand-back left nothing behind."""
    names = ["blocks.1.hook_resid_post"]
    _, before = compiled.run_with_cache(PROMPTS, names_filter=names, return_type=None)
    with pytest.raises((AssertionError, RuntimeError), match="CUDA|NVIDIA"):
        compiled.run_with_cache(PROMPTS, names_filter=names, device="cuda")
    _, after = compiled.run_with_cache(PROMPTS, names_filter=names, return_type=None)
    assert torch.equal(after[names[0]], before[names[0]])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the engine runs on the CPU")
def test_a_cache_kept_on_the_gpu_equals_the_one_on_the_cpu(compiled):
    names = ["blocks.1.hook_resid_post", "blocks.1.attn.hook_pattern"]
    logits_gpu, on_gpu = compiled.run_with_cache(PROMPTS, names_filter=names, device="cuda",
                                                 max_new_tokens=3)
    logits_cpu, on_cpu = compiled.run_with_cache(PROMPTS, names_filter=names, max_new_tokens=3)
    assert logits_gpu.is_cuda and all(on_gpu[name].is_cuda for name in names)
    torch.testing.assert_close(logits_gpu.cpu(), logits_cpu, **TOLERANCE)
    for name in names:
        torch.testing.assert_close(on_gpu[name].cpu(), on_cpu[name], **TOLERANCE, msg=name)
