"""Attention scores and patterns are built when read, one name (or one prompt) at a time, and a
cache that would not fit in memory is refused before the engine runs.

Values are checked against the formula the cache used to apply to the whole batch at once (the
rotated q and k from the same cache), through every way of reading a cache.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from einops import einsum, repeat
from torch import Tensor

from vlens import HookedVLLM
from vlens.engine import memory_budget
from vlens.engine.memory_budget import CacheTooLarge, CallSize, held_names, value_bytes
from vlens.hooked.cache import VLensCache
from vlens.mappings._tiny import VOCAB_SIZE
from vlens.names.lazy_patterns import LazyAttention

ARCH = "llama"  # grouped keys: 4 query heads read 2 key heads
TEXTS = ["The quick brown fox jumps over the lazy dog, and then", "Hello world"]
LAYER = 1
CLOSE = dict(atol=1e-5, rtol=1e-5)
STAGES = ("attn_scores", "pattern")


def name(stage: str, layer: int = LAYER) -> str:
    return f"blocks.{layer}.attn.hook_{stage}"


def attention_names(name: str) -> bool:
    return any(f"attn.hook_{part}" in name for part in (*STAGES, "rot_q", "rot_k"))


def eager(cache: VLensCache, model: HookedVLLM, stage: str, layer: int = LAYER) -> Tensor:
    """The value as the cache computed it before it was lazy: the whole padded batch at once."""
    q, k = cache[name("rot_q", layer)], cache[name("rot_k", layer)]
    scale = model.checkpoint.hook_specs[name("attn_scores", layer)].compute.scale
    mask = cache.attention_mask
    k = repeat(k, "b k kv d -> b k (kv group) d", group=q.shape[2] // k.shape[2])
    scores = einsum(q.float(), k.float(), "b q h d, b k h d -> b h q k") * scale
    n = q.shape[1]
    visible = torch.ones(n, n, dtype=torch.bool).tril()[None, None] & mask[:, None, None, :]
    scores = scores.masked_fill(~visible, float("-inf")).to(q.dtype)
    if stage == "attn_scores":
        return scores
    pattern = scores.float().softmax(dim=-1).nan_to_num(0.0)
    return pattern.masked_fill(~mask[:, None, :, None], 0.0).to(scores.dtype)


@pytest.fixture
def model(hooked) -> HookedVLLM:
    return hooked(ARCH)


@pytest.fixture
def builds(monkeypatch) -> list[str]:
    """Each build of a lazy value: "batch" or "request"."""
    calls: list[str] = []
    build, build_request = LazyAttention.build, LazyAttention.build_request

    def counted_build(self: LazyAttention) -> Tensor:
        calls.append("batch")
        return build(self)

    def counted_request(self: LazyAttention, index: int) -> Tensor:
        calls.append("request")
        return build_request(self, index)

    monkeypatch.setattr(LazyAttention, "build", counted_build)
    monkeypatch.setattr(LazyAttention, "build_request", counted_request)
    return calls


# ---- (a) the values, through every access path --------------------------------------------------


def test_run_with_cache_builds_nothing_until_a_pattern_is_read(model, builds):
    _, cache = model.run_with_cache(TEXTS, names_filter=attention_names, return_type=None)
    assert name("pattern") in cache and ("pattern", LAYER) in cache
    assert name("pattern") in list(cache) and name("pattern") in cache.keys()
    assert len(cache) == 4 * model.cfg.n_layers
    assert builds == []
    cache.unpadded(name("attn_scores"), 1)
    assert builds == ["request"]  # that prompt's scores alone, not kept
    first = cache["pattern", LAYER]
    assert builds == ["request", "batch"]
    assert cache[name("pattern")] is first  # built once, kept
    assert builds == ["request", "batch"]


ACCESS_PATHS: dict[str, Callable[[VLensCache, str, str], Tensor]] = {
    "name": lambda cache, full, short: cache[full],
    "short form": lambda cache, full, short: cache[short, LAYER],
    "negative layer": lambda cache, full, short: cache[short, LAYER - cache.model.cfg.n_layers],
    "cache_dict": lambda cache, full, short: cache.cache_dict[full],
    "items": lambda cache, full, short: dict(cache.items())[full],
    "values": lambda cache, full, short: list(cache.values())[list(cache.keys()).index(full)],
    "iteration": lambda cache, full, short: {key: cache[key] for key in cache}[full],
    "to": lambda cache, full, short: cache.to("cpu")[full],
    "stack_activation": lambda cache, full, short: cache.stack_activation(short)[LAYER],
    "unpadded": lambda cache, full, short: torch.stack(
        [padded(cache.unpadded(full, i), int(cache.lengths.max())) for i in range(2)]
    ),
}


def padded(value: Tensor, positions: int) -> Tensor:
    """One request's unpadded value laid into its padded batch's frame, for comparison: the box
    of real positions, ``nan`` elsewhere (compared only where real)."""
    frame = value.new_full((value.shape[0], positions, positions), float("nan"))
    frame[:, : value.shape[1], : value.shape[2]] = value
    return frame


@pytest.mark.parametrize("path", ACCESS_PATHS)
@pytest.mark.parametrize("stage", STAGES)
def test_every_access_path_gives_the_eager_values(model, path: str, stage: str):
    _, cache = model.run_with_cache(TEXTS, names_filter=attention_names, return_type=None)
    expected = eager(cache, model, stage)
    value = ACCESS_PATHS[path](cache, name(stage), stage)
    assert value.shape == expected.shape
    if path == "unpadded":
        real = ~value.isnan()
        assert real.sum() == sum(model.cfg.n_heads * int(n) ** 2 for n in cache.lengths)
        value, expected = value[real], expected[real]
    torch.testing.assert_close(value, expected, **CLOSE)


@pytest.mark.parametrize("stage", STAGES)
def test_a_slice_of_the_batch_stays_unbuilt_and_equal(model, builds, stage: str):
    _, cache = model.run_with_cache(TEXTS, names_filter=attention_names, return_type=None)
    expected = eager(cache, model, stage)
    one = cache.apply_slice_to_batch_dim(1)
    both = cache.apply_slice_to_batch_dim(slice(0, 2))
    assert builds == []
    assert isinstance(one, VLensCache) and not one.has_batch_dim
    torch.testing.assert_close(one[name(stage)], expected[1], **CLOSE)
    torch.testing.assert_close(both[name(stage)], expected, **CLOSE)
    assert one.lengths.tolist() == [int(cache.lengths[1])]


def test_one_prompt_without_its_batch_axis(model, builds):
    _, cache = model.run_with_cache(
        TEXTS[0], names_filter=attention_names, return_type=None, remove_batch_dim=True
    )
    assert builds == []
    _, batched = model.run_with_cache(TEXTS[0], names_filter=attention_names, return_type=None)
    for stage in STAGES:
        torch.testing.assert_close(cache[name(stage)], eager(batched, model, stage)[0], **CLOSE)


def test_transformer_lens_analysis_builds_no_pattern(model, builds):
    _, cache = model.run_with_cache(TEXTS[0])
    cache.accumulated_resid(apply_ln=True, incl_mid=True)
    cache.decompose_resid(apply_ln=True)
    cache.stack_head_results(apply_ln=True)
    cache.get_full_resid_decomposition(expand_neurons=True, apply_ln=True)
    cache.compute_head_results()
    cache.to("cpu").remove_batch_dim()
    assert builds == []
    n = int(cache.lengths[0])
    assert cache["pattern", LAYER].shape == (model.cfg.n_heads, n, n)


def test_a_plain_dict_holds_built_values(model):
    _, values = model.run_with_cache(
        TEXTS, names_filter=attention_names, return_type=None, return_cache_object=False
    )
    assert type(values) is dict and all(isinstance(v, Tensor) for v in values.values())
    _, cache = model.run_with_cache(TEXTS, names_filter=attention_names, return_type=None)
    torch.testing.assert_close(values[name("pattern")], eager(cache, model, "pattern"), **CLOSE)


def test_generated_positions(model):
    _, cache = model.run_with_cache(
        TEXTS, names_filter=attention_names, return_type=None, max_new_tokens=3
    )
    for stage in STAGES:
        expected = eager(cache, model, stage)
        assert cache[name(stage)].shape[-1] == int(cache.lengths.max())
        torch.testing.assert_close(cache[name(stage)], expected, **CLOSE)


def test_a_pattern_hook_on_one_prompt_shows_in_its_cached_pattern(model):
    """The hooked prompt's pattern is the worker's, as its hook left it; the other's is
    rebuilt; both through the whole batch and one prompt at a time."""

    def halve(pattern: Tensor, hook: object) -> Tensor:
        return pattern * 0.5

    hooks = [[(name("pattern"), halve)], []]
    _, cache = model.run_with_cache(
        TEXTS, names_filter=attention_names, return_type=None, prompt_hooks=hooks
    )
    expected = eager(cache, model, "pattern")
    expected[0] *= 0.5
    unpadded = [cache.unpadded(name("pattern"), i) for i in range(2)]
    torch.testing.assert_close(cache[name("pattern")], expected, **CLOSE)
    for index, value in enumerate(unpadded):
        n = int(cache.lengths[index])
        torch.testing.assert_close(value, expected[index, :, :n, :n], **CLOSE)


# ---- (b) memory: linear in the prompt until a pattern is read -----------------------------------

#: Run in a fresh process: in a long test session, memory freed by earlier tests stays resident
#: and is reused, and the growth of resident memory no longer shows what a call allocates.
MEASURE_IN_A_FRESH_PROCESS = r"""
import json, sys
from pathlib import Path
import torch
from transformers import AutoModelForCausalLM, LlamaConfig
from vlens import HookedVLLM
from vlens.mappings._tiny import VOCAB_SIZE
from vlens.testing.tiny import build_tokenizer

POSITIONS, LAYERS, HEADS = 2000, 8, 8
folder = Path(sys.argv[1])
# A random Llama with enough layers and heads that its patterns at 2,000 positions (1 GiB in
# float32) stand far above the process's noise.
config = LlamaConfig(
    vocab_size=VOCAB_SIZE, hidden_size=HEADS * 32, intermediate_size=256,
    num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=2,
    max_position_embeddings=2048, tie_word_embeddings=True,
)
torch.manual_seed(0)
AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
build_tokenizer().save_pretrained(folder)
model = HookedVLLM.from_pretrained(folder, dtype="float32", max_model_len=2048)

def status_bytes(field):
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024

def reset_peak():  # the high-water mark of resident memory (VmHWM) starts again from now
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")

tokens = torch.randint(2, VOCAB_SIZE, (1, POSITIONS), generator=torch.Generator().manual_seed(0))
patterns = [f"blocks.{layer}.attn.hook_pattern" for layer in range(LAYERS)]
model.run_with_cache(tokens, names_filter=patterns[:1], return_type=None)  # warm the engine
reset_peak()
before = status_bytes("VmRSS")
_, cache = model.run_with_cache(tokens, names_filter=patterns, return_type=None)
after_run = status_bytes("VmHWM") - before
read = [cache[pattern] for pattern in patterns[::2]]
print("MEASURED " + json.dumps({
    "all_patterns": LAYERS * HEADS * POSITIONS**2 * 4,
    "read_bytes": sum(value.nbytes for value in read),
    "after_run": after_run,
    "peak": status_bytes("VmHWM") - before,
}))
"""


def test_reading_half_the_patterns_of_a_long_prompt_peaks_near_their_size(tmp_path):
    """Every layer's pattern of one 2,000-token prompt in ``names_filter``: the call holds q and
    k only, and reading half the patterns peaks below 1.3x what is read."""
    import json
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-c", MEASURE_IN_A_FRESH_PROCESS, str(tmp_path / "wide-llama")],
        capture_output=True, text=True, timeout=600,
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("MEASURED ")]
    assert lines, result.stderr[-3000:]
    measured = json.loads(lines[0].removeprefix("MEASURED "))
    all_patterns, read_bytes = measured["all_patterns"], measured["read_bytes"]
    after_run, peak = measured["after_run"], measured["peak"]
    assert read_bytes == all_patterns // 2
    assert after_run < 0.1 * all_patterns, f"run_with_cache grew by {after_run / 2**20:.0f} MiB"
    assert read_bytes <= 1.02 * peak, "the measurement does not see the patterns read"
    assert peak < 1.3 * read_bytes, (
        f"peak growth {peak / 2**20:.0f} MiB for {read_bytes / 2**20:.0f} MiB of patterns read"
    )


# ---- (c) a cache that would not fit is refused before the engine runs ---------------------------


def test_a_cache_larger_than_the_memory_available_is_refused_before_running(model, monkeypatch):
    monkeypatch.setattr(memory_budget, "available_bytes", lambda device: 2**20)
    ran = []
    monkeypatch.setattr(model.engine, "run", lambda *args, **kwargs: ran.append(args))
    with pytest.raises(CacheTooLarge) as refused:
        model.run_with_cache([TEXTS[0]] * 8)
    message = str(refused.value)
    assert ran == []
    assert "MiB" in message and "available on cpu" in message
    for alternative in ("names_filter", "shorter", "device=", "vlens cache"):
        assert alternative in message


def test_patterns_count_as_their_q_and_k_until_read(model):
    specs, config = model.checkpoint.hook_specs, model.checkpoint.hf_config
    pattern = name("pattern")
    kept = [name("rot_q"), name("rot_k")]
    assert held_names(specs, [pattern], kept, build_all=False) == kept
    assert held_names(specs, [pattern], kept, build_all=True) == [*kept, pattern]
    size = CallSize(prompts=2, positions=100, samples=1, itemsize=4)
    heads, d_head = model.cfg.n_heads, model.cfg.d_head
    assert value_bytes(specs[pattern], config, size) == 2 * heads * 100 * 100 * 4
    assert value_bytes(specs[name("rot_q")], config, size) == 2 * 100 * heads * d_head * 4


def test_only_patterns_built_for_a_plain_dict_count_in_full(model, monkeypatch):
    """400 positions: one layer's pattern takes 2.5 MiB, its q and k 0.3 MiB. With 2 MiB
    available the cache runs, unless a plain dict would build the pattern."""
    monkeypatch.setattr(memory_budget, "available_bytes", lambda device: 2 * 2**20)
    tokens = torch.randint(2, VOCAB_SIZE, (1, 400), generator=torch.Generator().manual_seed(0))
    _, cache = model.run_with_cache(tokens, names_filter=[name("pattern")], return_type=None)
    assert cache[name("pattern")].shape == (1, model.cfg.n_heads, 400, 400)
    with pytest.raises(CacheTooLarge, match="return_cache_object=False"):
        model.run_with_cache(
            tokens, names_filter=[name("pattern")], return_type=None, return_cache_object=False
        )
