"""Hook functions on attention scores, patterns and per-head results: the worker computes the
hooked layer's attention explicitly, so edits land exactly as in TransformerLens's own
``TransformerBridge`` on the same checkpoint, stay within their request, and work on decode steps
and prefill chunks; what cannot work is refused when the hook is added."""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch
from torch import Tensor
from transformers import AutoConfig

from vlens.hooked.hook_registry import HookRegistry
from vlens.mappings import mapping_for
from vlens.names.compiled import declare
from vlens.names.rules import NameRules
from vlens.runtime.attention.explicit import unsupported
from vlens.testing.tiny import tiny_model

TEXT = "The river ran past the old mill, and every morning"
OTHER = "A computer is a machine that follows instructions"
LAYER = 1
HEAD = 1
QUERY = 5  # an absolute query position
ARCHS = ("llama", "qwen3", "gpt2")
RELATIVE = 1e-4  # fp32 parity, relative to the largest logit


def scores(layer: int = LAYER) -> str:
    return f"blocks.{layer}.attn.hook_attn_scores"


def pattern(layer: int = LAYER) -> str:
    return f"blocks.{layer}.attn.hook_pattern"


def result(layer: int = LAYER) -> str:
    return f"blocks.{layer}.attn.hook_result"


# ---- hook functions, written for any [batch, head, q_pos, k_pos] slice of a causal pattern ------


def query_positions(value: Tensor) -> Tensor:
    """Absolute positions of a pattern's query rows: the last ``q_pos`` of its ``k_pos`` keys
    (a whole prompt, a prefill chunk or one decode row)."""
    n_queries, n_keys = value.shape[-2:]
    return torch.arange(n_keys - n_queries, n_keys, device=value.device)


def zero_head_at_query(value: Tensor, hook) -> None:
    """One head's attention at one query set to zero, in place."""
    value[:, HEAD, query_positions(value) == QUERY, :] = 0.0


def uniform_over_previous(value: Tensor, hook) -> Tensor:
    """A new pattern: each query attends equally to the tokens before it (the first to itself)."""
    queries = query_positions(value)[:, None]
    keys = torch.arange(value.shape[-1], device=value.device)[None, :]
    previous = (keys < queries) | ((queries == 0) & (keys == 0))
    weights = previous.to(value.dtype) / previous.sum(-1, keepdim=True).to(value.dtype)
    return weights.expand_as(value).clone()


def halve_scores(value: Tensor, hook) -> Tensor:
    return value * 0.5


def zero_head_result(value: Tensor, hook) -> None:
    value[:, :, HEAD] = 0.0


EDITS: dict[str, tuple[str, Callable]] = {
    "zero one head's pattern at a query": (pattern(), zero_head_at_query),
    "uniform pattern over previous tokens": (pattern(), uniform_over_previous),
    "scaled scores": (scores(0), halve_scores),
    "zeroed head result": (result(), zero_head_result),
}


# ---- TransformerLens's bridge on the same checkpoint ---------------------------------------------


@functools.cache
def bridge(arch: str):
    """``TransformerBridge`` on the tiny checkpoint, without weight processing, with per-head
    results computed (TransformerLens offers ``hook_result`` only then)."""
    from transformer_lens.model_bridge import TransformerBridge

    model = TransformerBridge.boot_transformers(str(tiny_model(arch)), device="cpu", dtype=torch.float32)
    model.enable_compatibility_mode(no_processing=True)
    model.set_use_attn_result(True)
    return model


def assert_relative(actual: Tensor, expected: Tensor, tolerance: float = RELATIVE) -> None:
    error = (actual.float() - expected.float()).abs().max() / expected.float().abs().max()
    assert error <= tolerance, f"relative error {error:.2e} > {tolerance:.0e}"


# ---- parity with TransformerLens -----------------------------------------------------------------


@pytest.mark.parametrize("edit", list(EDITS))
@pytest.mark.parametrize("arch", ARCHS)
def test_edits_equal_transformer_lens(hooked, arch: str, edit: str):
    model = hooked(arch)
    name, function = EDITS[edit]
    tokens = model.to_tokens(TEXT)
    with torch.no_grad():
        expected = bridge(arch).run_with_hooks(tokens, fwd_hooks=[(name, function)])
    logits = model.run_with_hooks(TEXT, fwd_hooks=[(name, function)])
    assert_relative(logits, expected)
    plain = model.run_with_hooks(TEXT)
    assert (logits - plain).abs().max() > 1e-2, "the edit changed nothing"


@pytest.mark.parametrize("arch", ARCHS)
def test_a_hook_sees_the_real_pattern_and_a_look_changes_nothing(hooked, arch: str):
    model = hooked(arch)
    seen: dict[str, Tensor] = {}

    def look(value: Tensor, hook) -> None:
        seen[hook.name] = value.cpu()  # the engine's device; the reference runs on the CPU

    plain = model.run_with_hooks(TEXT)
    logits = model.run_with_hooks(TEXT, fwd_hooks=[(pattern(), look), (scores(), look)])
    torch.testing.assert_close(logits, plain, rtol=0, atol=1e-5)
    with torch.no_grad():
        _, reference = bridge(arch).run_with_cache(model.to_tokens(TEXT))
    for name in (pattern(), scores()):
        assert seen[name].shape == reference[name].shape
        finite = reference[name].isfinite()
        assert torch.equal(seen[name].isfinite(), finite)
        assert_relative(seen[name][finite], reference[name][finite], 1e-5)


def test_the_cache_holds_what_the_hooks_left(hooked):
    """TransformerLens caches a value after its hooks ran; so does vlens for a layer computed
    explicitly, and the other layers' patterns are still rebuilt."""
    model = hooked("llama")
    names = [scores(), pattern(), result(), pattern(0)]
    hooks = [
        (scores(), halve_scores), (pattern(), zero_head_at_query), (result(), zero_head_result)
    ]
    with model.hooks(fwd_hooks=hooks):
        logits, cache = model.run_with_cache(TEXT, names_filter=names)
    assert torch.all(cache[pattern()][0, HEAD, QUERY] == 0)
    assert torch.all(cache[result()][0, :, HEAD] == 0)
    with torch.no_grad(), bridge("llama").hooks(fwd_hooks=hooks):
        expected_logits, expected = bridge("llama").run_with_cache(model.to_tokens(TEXT))
    assert_relative(logits, expected_logits)
    for name in names:
        finite = expected[name].isfinite()
        assert torch.equal(cache[name].isfinite(), finite), name
        assert_relative(cache[name][finite], expected[name][finite])


def test_the_cache_over_decode_steps_holds_what_the_hooks_left(hooked):
    model = hooked("qwen3")
    with model.hooks(fwd_hooks=[(pattern(), uniform_over_previous)]):
        _, cache = model.run_with_cache(TEXT, names_filter=[pattern()], max_new_tokens=4)
    with torch.no_grad(), bridge("qwen3").hooks(fwd_hooks=[(pattern(), uniform_over_previous)]):
        _, expected = bridge("qwen3").run_with_cache(cache.tokens)
    assert cache[pattern()].shape == expected[pattern()].shape
    assert_relative(cache[pattern()], expected[pattern()], 1e-6)


# ---- requests, decode steps and prefill chunks ---------------------------------------------------


def test_a_hooked_prompt_leaves_the_other_bit_for_bit(hooked):
    """One prompt carries a pattern hook, the other none: the other's logits at every step equal
    those of the same batch run without the hook, bit for bit."""
    model = hooked("llama")
    logits: dict[tuple[str, int], list[Tensor]] = {}

    def recorder(run: str, request: int):
        def record(value: Tensor, hook) -> None:
            logits.setdefault((run, request), []).append(value.clone())

        return record

    def run(label: str, edit: list) -> list[list[int]]:
        first = [*edit, ("sampler.hook_logits", recorder(label, 0))]
        second = [("sampler.hook_logits", recorder(label, 1))]
        return model.generate(
            [TEXT, OTHER], max_new_tokens=4, do_sample=False, stop_at_eos=False,
            return_type="result", prompt_hooks=[first, second],
        )

    hooked_tokens = run("hooked", [(pattern(), uniform_over_previous)])
    plain_tokens = run("plain", [])
    assert hooked_tokens[1] == plain_tokens[1]
    assert len(logits["hooked", 1]) == len(logits["plain", 1]) == 4
    for edited, plain in zip(logits["hooked", 1], logits["plain", 1]):
        assert torch.equal(edited, plain)
    assert not torch.equal(logits["hooked", 0][0], logits["plain", 0][0])


@pytest.mark.parametrize("arch", ARCHS)
def test_generation_with_a_pattern_hook_equals_transformer_lens(hooked, arch: str):
    model = hooked(arch)
    shapes: list[tuple[int, ...]] = []

    def uniform(value: Tensor, hook) -> Tensor:
        shapes.append(tuple(value.shape))
        return uniform_over_previous(value, hook)

    generated = model.generate(
        TEXT, max_new_tokens=5, do_sample=False, stop_at_eos=False, return_type="tokens",
        fwd_hooks=[(pattern(), uniform)],
    )[0].tolist()
    with torch.no_grad(), bridge(arch).hooks(fwd_hooks=[(pattern(), uniform_over_previous)]):
        expected = bridge(arch).generate(
            model.to_tokens(TEXT), max_new_tokens=5, do_sample=False, stop_at_eos=False,
            verbose=False, return_type="tokens",
        )
    assert generated == expected[0].tolist()
    prompt, heads = len(model.token_lists(TEXT)[0]), model.cfg.n_heads
    assert shapes == [(1, heads, prompt, prompt)] + [(1, heads, 1, prompt + i) for i in range(1, 5)]


def test_prefill_chunks_see_every_earlier_key(hooked):
    """A prompt prefilled over several steps (an engine with a small ``max_num_batched_tokens``):
    a per-prompt hook sees each chunk's pattern, covering every key so far, and the edit gives
    what it gives on the whole prompt at once."""
    chunked = hooked("llama", max_num_batched_tokens=16, max_num_seqs=4)
    text = " ".join([TEXT] * 4)
    shapes: list[tuple[int, ...]] = []

    def uniform(value: Tensor, hook) -> Tensor:
        shapes.append(tuple(value.shape[-2:]))
        return uniform_over_previous(value, hook)

    logits = chunked.run_with_hooks(text, prompt_hooks=[[(pattern(), uniform)]])
    whole = hooked("llama").run_with_hooks(text, fwd_hooks=[(pattern(), uniform_over_previous)])
    assert len(shapes) > 2 and all(keys == sum(q for q, _ in shapes[: i + 1])
                                    for i, (_, keys) in enumerate(shapes))
    torch.testing.assert_close(logits, whole, rtol=1e-5, atol=1e-5)


def test_a_preempted_request_recomputes_its_history(hooked):
    """A small KV cache makes vLLM preempt requests and recompute them from their start: their
    rows arrive again from position 0, and vlens's key/value history starts over with them."""
    small = hooked(
        "llama", block_size=32, num_gpu_blocks_override=10, max_num_batched_tokens=64,
        max_num_seqs=8, max_model_len=256,
    )
    generator = torch.Generator().manual_seed(0)
    lengths = [3 + 13 * i for i in range(12)]
    prompts = [torch.randint(2, 500, (n,), generator=generator).tolist() for n in lengths]
    starts: list[int] = []

    def uniform(value: Tensor, hook) -> Tensor:
        if hook.first_position == 0:
            starts.extend(hook.requests)
        return uniform_over_previous(value, hook)

    def generate(model, function) -> list[list[int]]:
        return model.generate(  # per-prompt hooks: the small engine splits long prefills
            prompts, max_new_tokens=20, do_sample=False, stop_at_eos=False, return_type="result",
            prompt_hooks=[[(pattern(), function)]] * len(prompts),
        )

    preempted = generate(small, uniform)
    assert len(starts) > len(prompts), "no request was preempted: the test proves nothing"
    assert preempted == generate(hooked("llama"), uniform_over_previous)


def test_hook_point_surface_and_errors(hooked):
    model = hooked("gpt2")
    seen: list[tuple[str, int, int, bool]] = []

    def record(value: Tensor, hook) -> None:
        seen.append((hook.name, hook.layer(), hook.positions.tolist()[0][0], hook.is_prefill))

    model.generate(TEXT, max_new_tokens=2, do_sample=False, fwd_hooks=[(result(), record)])
    prompt = len(model.token_lists(TEXT)[0])
    assert seen == [(result(), LAYER, 0, True), (result(), LAYER, prompt, False)]

    from vlens import HookError

    with pytest.raises(HookError, match=r"on blocks.1.attn.hook_pattern returned shape"):
        model.run_with_hooks(TEXT, fwd_hooks=[(pattern(), lambda p, h: p[..., :2])])
    assert model.run_with_hooks(TEXT).shape[0] == 1  # the engine keeps serving


# ---- refusals ------------------------------------------------------------------------------------


def specs_of(arch: str) -> tuple[dict, AutoConfig]:
    config = AutoConfig.from_pretrained(tiny_model(arch))
    return mapping_for(config).expanded(config), config


def rules_of(specs: dict, compiled=None, tensor_parallel_size: int = 1) -> NameRules:
    return NameRules(specs, list(specs), compiled, None, tensor_parallel_size)


def test_deepseek_attention_names_are_refused_with_the_reason():
    specs, _ = specs_of("deepseek_v3")
    registry = HookRegistry(rules_of(specs))
    for name in (pattern(), scores(), result()):
        with pytest.raises(ValueError, match="multi-head latent attention"):
            registry.names(name)
    with pytest.raises(ValueError, match="rebuilds it afterwards"):  # rebuilt keys: no hooks
        registry.names("blocks.1.attn.hook_k")


def test_tensor_parallelism_is_refused_when_the_hook_is_added():
    specs, _ = specs_of("llama")
    with pytest.raises(NotImplementedError, match="tensor parallelism"):
        HookRegistry(rules_of(specs, tensor_parallel_size=2)).names(pattern())
    assert HookRegistry(rules_of(specs)).names(pattern()) == [pattern()]
    assert "tensor parallelism" in unsupported(tensor_parallel=True)  # the worker's
    assert unsupported(tensor_parallel=False) is None


def test_tensor_parallel_engine_refuses_and_keeps_serving():
    """On a real two-rank engine: refused when the hook is added (once the model passes its
    tensor-parallel size to its registry) or, by the workers' own guard, raised after the call;
    either way the engine keeps serving."""
    from vlens import HookedVLLM, HookError

    if torch.version.cuda is not None and torch.cuda.device_count() < 2:
        pytest.skip("two ranks need two GPUs here (on the CPU, two cores)")
    model = HookedVLLM.from_pretrained(tiny_model("llama"), dtype="float32", tensor_parallel_size=2)
    with pytest.raises((NotImplementedError, HookError), match="tensor parallelism"):
        model.run_with_hooks(TEXT, fwd_hooks=[(pattern(), lambda value, hook: None)])
    assert model.run_with_hooks(TEXT).shape[:2] == (1, len(model.token_lists(TEXT)[0]))


def test_a_compiled_engine_takes_pattern_hooks_only_where_declared():
    specs, config = specs_of("llama")
    compiled = declare(specs, config, [pattern()], [], None)  # read, not hooked
    with pytest.raises(ValueError, match=r"compiled_hooks=\['blocks.1.attn.hook_pattern'\]"):
        HookRegistry(rules_of(specs, compiled)).names(pattern())
    graph_hooks = declare(specs, config, [], [], None, hooks=[pattern()])
    assert HookRegistry(rules_of(specs, graph_hooks)).names(pattern()) == [pattern()]
    assert {site.event for site in (g.site for g in graph_hooks.graph_names)} >= {"call"}
