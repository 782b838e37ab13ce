"""A call's kept rows written into the host's padded batch as steps end (the compiled engine on one
rank, cache on the host): each row at its request and position, whatever order the steps list
requests in; zero wherever a request kept nothing; rows past a request's announced positions
and rows vLLM replaced left out, as :class:`~vlens.runtime.steps.kept_steps.KeptSteps` lays them out."""

from __future__ import annotations

import io

import pytest
import torch

from vlens.runtime.steps.kept_steps import KeptSteps, Segment
from vlens.runtime.steps.layout import RequestRows
from vlens.runtime.transfer.host_stream import HostStream, Slot, StepStage

KEEP_X = frozenset({"x"})
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")),
]


@pytest.fixture(params=DEVICES)
def device(request) -> torch.device:
    """Where the steps' rows are computed: on a GPU they go over by the copy engines."""
    return torch.device(request.param)


def rows(*values: float) -> torch.Tensor:
    return torch.tensor(values).reshape(-1, 1)


@pytest.fixture(params=[False, True], ids=["own memory", "shared memory"])
def shared(request) -> bool:
    """Whether the host rows are memory a user's process would map (:mod:`host_blocks`)."""
    return request.param


def stream_of(positions: dict[str, int], device: torch.device, shared: bool) -> HostStream:
    stream = HostStream(len(positions), device, shared)
    for index, (tag, count) in enumerate(positions.items()):
        stream.follow(tag, Slot(index, len(positions), count, shared))
    return stream


def step(stream: HostStream, requests: list[tuple[str, int, int]], values: torch.Tensor) -> None:
    """One step: ``(tag, length, first position)`` per request, in the step's row order."""
    keepers, start = [], 0
    for tag, length, first in requests:
        keepers.append(RequestRows(tag, start, start + length, first, 0))
        start += length
    stream.begin_step(keepers)
    stream.write(["x"], values.to(stream.device)[None])
    stream.end_step()


def test_rows_land_at_their_request_and_position_as_the_kept_steps_lay_them_out(device, shared):
    stream = stream_of({"a": 4, "b": 4}, device, shared)
    store = KeptSteps()
    steps = [
        ([("a", 3, 0), ("b", 2, 0)], rows(0, 1, 2, 3, 4)),
        ([("b", 1, 2), ("a", 1, 3)], rows(10, 11)),  # b before a
    ]
    for requests, values in steps:
        step(stream, requests, values)
        store.add("x", [Segment(tag, n, first) for tag, n, first in requests], values)
    keeps = {"a": KEEP_X, "b": KEEP_X}
    streamed = stream.take(["a", "b"], keeps)["x"]
    stored = store.take(["a", "b"], keeps, "cpu")["x"]
    assert streamed.values.squeeze(-1).tolist() == [[0, 1, 2, 11], [3, 4, 10, 0]]
    assert streamed.spans == stored.spans == [[(0, 4)], [(0, 3)]]
    assert torch.equal(streamed.values, stored.values)


def test_padding_and_names_a_request_does_not_keep_are_zero_whatever_memory_held(device, shared):
    stream = stream_of({"a": 3, "b": 3, "c": 3}, device, shared)
    step(stream, [("a", 2, 0), ("b", 2, 0), ("c", 1, 0)], rows(1, 2, 3, 4, 5))
    if device.type == "cuda":
        torch.cuda.synchronize()  # the step's copy has landed
    stream.host["x"].fill_(99.0)  # what an uninitialised allocation may hold
    step(stream, [("a", 1, 2)], rows(6))
    keeps = {"a": KEEP_X, "b": KEEP_X, "c": frozenset()}
    taken = stream.take(["a", "b", "c"], keeps)["x"]
    assert taken.values.squeeze(-1).tolist() == [[99, 99, 6], [99, 99, 0], [0, 0, 0]]
    assert taken.spans == [[(0, 3)], [(0, 2)], []]


def test_a_row_past_the_announced_positions_is_left_out(device, shared):
    """With asynchronous scheduling vLLM runs one more forward for a request that has just
    finished: that row goes to the spare row, not into the next request's positions."""
    stream = stream_of({"a": 2, "b": 2}, device, shared)
    step(stream, [("a", 2, 0), ("b", 2, 0)], rows(1, 2, 3, 4))
    step(stream, [("a", 1, 2), ("b", 1, 2)], rows(5, 6))  # one position too many each
    taken = stream.take(["a", "b"], {"a": KEEP_X, "b": KEEP_X})["x"]
    assert taken.values.squeeze(-1).tolist() == [[1, 2], [3, 4]]
    assert taken.spans == [[(0, 2)], [(0, 2)]]


def test_replaced_rows_are_dropped_and_an_early_stop_narrows_the_batch(device, shared):
    """A preempted request recomputed from position 1 (its rows from 1 on replaced), and every
    request ending before its announced positions: the batch is as wide as what was kept."""
    stream = stream_of({"a": 6, "b": 6}, device, shared)
    step(stream, [("a", 3, 0), ("b", 1, 0)], rows(0, 1, 2, 7))
    step(stream, [("a", 1, 1)], rows(11))
    taken = stream.take(["b", "a"], {"a": KEEP_X, "b": KEEP_X})["x"]  # finished in another order
    assert taken.values.squeeze(-1).tolist() == [[7, 0], [0, 11]]
    assert taken.spans == [[(0, 1)], [(0, 2)]]
    assert taken.values.is_contiguous()


def test_names_written_together_land_as_each_written_alone(device, shared):
    """Three names' rows of a step as one ``[names, rows, ...]`` tensor, over steps that take
    each way of copying (decode rows all at one position, then at mixed ones; a prefill of
    equal prompts): each name's cache equals what the kept steps lay out."""
    positions = {f"r{i}": 5 for i in range(6)}
    stream = stream_of(positions, device, shared)
    store = KeptSteps()
    names = ["p", "q", "s"]
    generator = torch.Generator().manual_seed(0)
    steps = [
        [(f"r{i}", 3, 0) for i in range(6)],  # prefill of equal prompts
        [(f"r{i}", 1, 3) for i in (0, 2, 1, 3, 4, 5)],  # one position, out of order
        [("r5", 1, 4), ("r0", 1, 4), ("r1", 2, 3), ("r2", 1, 4)],  # r1 recomputed from 3
    ]
    for requests in steps:
        keepers, start = [], 0
        for tag, length, first in requests:
            keepers.append(RequestRows(tag, start, start + length, first, 0))
            start += length
        values = torch.randn(len(names), start, 2, 3, generator=generator)
        stream.begin_step(keepers)
        stream.write(names, values.to(device))
        stream.end_step()
        segments = [Segment(tag, n, first) for tag, n, first in requests]
        for name, name_values in zip(names, values):
            store.add(name, segments, name_values)
    tags = list(positions)
    keeps = {tag: frozenset(names) for tag in tags}
    streamed, stored = stream.take(tags, keeps), store.take(tags, keeps, "cpu")
    for name in names:
        assert streamed[name].spans == stored[name].spans
        assert torch.equal(streamed[name].values, stored[name].values)


def test_names_staged_one_by_one_land_as_each_written_alone(device):
    """The default engine's hook sites stage a step's names as they fire (:class:`StepStage`)
    and write them as the step ends, one tensor per shape: with the stage grown within the
    first step, rows selected by a slice or by an index, and two shapes, each name's cache
    equals what the kept steps lay out."""
    positions = {f"r{i}": 4 for i in range(3)}
    stream = stream_of(positions, device, False)
    store, stage = KeptSteps(), StepStage()
    generator = torch.Generator().manual_seed(1)
    steps = [  # (requests, the rows they hold among the step's)
        ([("r0", 2, 0), ("r1", 2, 0), ("r2", 2, 0)], slice(0, 6)),
        ([("r2", 1, 2), ("r0", 1, 2)], torch.tensor([1, 3])),
        ([("r1", 1, 2), ("r0", 1, 3)], slice(1, 3)),
    ]
    for requests, selection in steps:
        keepers, start = [], 0
        for tag, length, first in requests:
            keepers.append(RequestRows(tag, start, start + length, first, 0))
            start += length
        stream.begin_step(keepers)
        segments = [Segment(tag, n, first) for tag, n, first in requests]
        for name in "pqst":
            shape = (3,) if name == "t" else (2, 3)
            value = torch.randn(8, *shape, generator=generator)
            stage.add(name, value.to(device), selection.to(device)
                      if isinstance(selection, torch.Tensor) else selection)
            store.add(name, segments, value[selection])
        stage.write(stream)
        stream.end_step()
    tags = list(positions)
    keeps = {tag: frozenset("pqst") for tag in tags}
    streamed, stored = stream.take(tags, keeps), store.take(tags, keeps, "cpu")
    assert set(streamed) == set("pqst")
    for name in "pqst":
        assert streamed[name].spans == stored[name].spans
        assert torch.equal(streamed[name].values, stored[name].values), name


def test_a_compiled_call_writes_its_cache_on_the_host_as_steps_end(hooked, monkeypatch):
    """On one rank with the cache on the host, the compiled engine takes this path, and the cache
    equals eager mode's."""
    taken = []
    original = HostStream.take
    monkeypatch.setattr(HostStream, "take", lambda self, *a: taken.append(1) or original(self, *a))
    names = ("blocks.0.hook_resid_post", "blocks.1.hook_resid_post", "blocks.1.attn.hook_z")
    compiled = hooked("llama", compiled_capture=names)
    prompts = ["The host stream", "keeps rows as steps end, in their place"]
    _, cache = compiled.run_with_cache(prompts, max_new_tokens=3, names_filter=list(names))
    _, expected = hooked("llama").run_with_cache(prompts, max_new_tokens=3, names_filter=list(names))
    assert taken
    for name in names:
        torch.testing.assert_close(cache[name], expected[name], rtol=1e-5, atol=1e-5)
    # the two resid_post were written into one host tensor; each name saves alone, uncopied
    assert_saved_alone(cache, names)


def test_the_default_engine_writes_its_cache_on_the_host_as_steps_end(hooked, monkeypatch):
    """Names read where no hook function runs go into the host's cache as steps end on the
    default engine too (eager here; on a GPU its hook sites), and the cache equals the one kept
    request by request where a hook function runs at each name."""
    written = []
    original = HostStream.write
    monkeypatch.setattr(HostStream, "write",
                        lambda self, names, *a: written.extend(names) or original(self, names, *a))
    names = ("blocks.0.hook_resid_post", "blocks.1.attn.hook_z", "blocks.1.mlp.hook_post")
    model = hooked("llama")
    prompts = ["The host stream", "keeps rows as steps end, in their place, prompt by prompt"]
    _, cache = model.run_with_cache(prompts, max_new_tokens=3, names_filter=list(names))
    assert set(names) <= set(written)  # and the logits, where run_with_cache reads them
    written.clear()
    with model.hooks(fwd_hooks=[(name, lambda value, hook: None) for name in names]):
        _, expected = model.run_with_cache(prompts, max_new_tokens=3, names_filter=list(names))
    assert not set(written) & set(names)
    for name in names:
        assert torch.equal(cache[name], expected[name]), name
    assert_saved_alone(cache, names)


def assert_saved_alone(cache, names) -> None:
    """Each name's value has a storage of its own bytes: ``torch.save`` of one name writes that
    name (not every name written with it), as with an eager cache."""
    for name in names:
        value = cache[name]
        assert value.untyped_storage().nbytes() == value.nbytes, name
        saved = io.BytesIO()
        torch.save(value, saved)
        assert value.nbytes < len(saved.getvalue()) < value.nbytes + 2048, name


def test_a_worker_process_writes_its_rows_into_memory_this_process_maps(
    hooked, engine_args, mapped_references
):
    """A compiled engine whose worker is a process of its own (vLLM's multiprocessing executor
    on one rank) writes the kept rows into shared memory as steps end, the cache is views of it
    here, and it equals eager mode's (values handed back whole, not through the shared memory,
    would not be counted)."""
    from vlens import HookedVLLM
    from vlens.testing.tiny import tiny_model

    names = ("blocks.0.hook_resid_post", "blocks.1.attn.hook_z", "blocks.1.mlp.hook_post")
    compiled = HookedVLLM.from_pretrained(
        tiny_model("llama"), dtype="float32", distributed_executor_backend="mp",
        compiled_capture=names, **engine_args,
    )
    assert not compiled.engine.in_process
    prompts = ["The host stream", "crosses to this process, uncopied"]
    logits, cache = compiled.run_with_cache(prompts, max_new_tokens=3)
    expected_logits, expected = hooked("llama").run_with_cache(prompts, max_new_tokens=3,
                                                               names_filter=list(names))
    assert {tuple(cache[name].shape) for name in names} <= {reference[5] for reference in mapped_references}
    # compiled against eager: Inductor's fusion of the traced hooks (as tests/engine/test_compiled.py)
    for name in names:
        torch.testing.assert_close(cache[name], expected[name], rtol=1e-4, atol=1e-5, msg=name)
    torch.testing.assert_close(logits, expected_logits, rtol=1e-4, atol=1e-5)
    assert_saved_alone(cache, names)
