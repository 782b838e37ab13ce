"""An interrupted call leaves the engine serving, and a hook cannot call the model again.

The scenarios run in one child process on one engine: a regression here hangs vLLM's step loop
forever, and the child's time limit turns that into a failure instead of a stuck suite.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from vlens.engine.interrupts import WorkerWaits


def as_a_terminal_starts_it() -> None:
    """In a child before it runs: SIGINT's default action, as a terminal starts a program. A
    suite started in the background of a shell without job control inherits SIGINT ignored,
    and Python then never raises KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture
def sigint_raises():
    """The test process's SIGINT raising KeyboardInterrupt (see :func:`as_a_terminal_starts_it`)
    for the test; what it was, after."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


CHILD = r"""
import json, sys, time
import torch
from vlens import HookedVLLM
from vlens.testing.tiny import tiny_model

model = HookedVLLM.from_pretrained(tiny_model("qwen3"), dtype="float32")
PROMPTS = ["An interrupted call", "leaves the engine serving"]
reference_logits = model(PROMPTS[0])
def greedy_text(prompts, max_new_tokens=8):
    return model.generate(prompts, max_new_tokens=max_new_tokens, do_sample=False, verbose=False)

reference_text = greedy_text(PROMPTS)

def report(scenario, **facts):
    recovered = {
        "logits_equal": torch.equal(model(PROMPTS[0]), reference_logits),
        "generation_equal": greedy_text(PROMPTS) == reference_text,
    }
    print("RESULT " + json.dumps({"scenario": scenario, **facts, **recovered}), flush=True)

# 1. A real SIGINT from outside (the parent sends it) while a long generation runs: a hook that
# only looks says when decoding has begun, and slows each step so that the generation cannot end
# before the signal arrives.
steps = []
def announce_decoding(value, hook):
    steps.append(hook.is_prefill)
    if steps.count(False) == 3:
        print("GENERATING", flush=True)
    time.sleep(0.01)
try:
    model.generate(PROMPTS * 2, max_new_tokens=400, do_sample=False, verbose=False,
                   fwd_hooks=[("blocks.0.hook_resid_post", announce_decoding)])
    report("sigint", raised=None)
except KeyboardInterrupt:
    report("sigint", raised="KeyboardInterrupt")

# 2. Hook functions that raise KeyboardInterrupt or SystemExit.
for exception in (KeyboardInterrupt, SystemExit):
    def interrupting(value, hook, exception=exception):
        raise exception
    try:
        model.run_with_hooks(PROMPTS[0], fwd_hooks=[("blocks.1.hook_resid_mid", interrupting)])
        report(exception.__name__, raised=None)
    except BaseException as raised:
        report(exception.__name__, raised=type(raised).__name__)

# 3. A hook function that calls the model.
def calls_the_model(value, hook):
    model.run_with_cache("inside a hook")
start = time.monotonic()
try:
    model.run_with_hooks(PROMPTS[0], fwd_hooks=[("blocks.0.hook_resid_post", calls_the_model)])
    report("reentrant", raised=None, message="", seconds=time.monotonic() - start)
except Exception as raised:
    report("reentrant", raised=type(raised).__name__, message=str(raised),
           seconds=time.monotonic() - start)
"""


@pytest.fixture(scope="module")
def scenarios() -> dict[str, dict]:
    """Run the child once: SIGINT it as soon as its long generation decodes; its results by
    scenario."""
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=as_a_terminal_starts_it,
    )
    try:
        for line in child.stdout:
            if line.startswith("GENERATING"):
                child.send_signal(signal.SIGINT)
                break
        stdout, stderr = child.communicate(timeout=400)
    except subprocess.TimeoutExpired:
        child.kill()
        stdout, stderr = child.communicate()
        pytest.fail(f"the engine hung after an interrupt:\n{stderr[-3000:]}")
    results = [json.loads(line[7:]) for line in stdout.splitlines() if line.startswith("RESULT ")]
    assert len(results) == 4, stderr[-3000:]
    return {result["scenario"]: result for result in results}


def test_sigint_during_generate_reaches_the_caller_and_the_next_calls_are_correct(scenarios):
    result = scenarios["sigint"]
    assert result["raised"] == "KeyboardInterrupt"
    assert result["logits_equal"] and result["generation_equal"], result


@pytest.mark.parametrize("exception", ["KeyboardInterrupt", "SystemExit"])
def test_a_hook_raising_exception_reaches_the_caller_and_the_next_calls_are_correct(
    scenarios, exception
):
    result = scenarios[exception]
    assert result["raised"] == exception
    assert result["logits_equal"] and result["generation_equal"], result


def test_a_hook_that_calls_the_model_gets_a_clear_error_at_once(scenarios):
    result = scenarios["reentrant"]
    assert result["raised"] == "HookError"
    assert "a hook function cannot call the model" in result["message"]
    assert "calls_the_model" in result["message"]
    assert result["seconds"] < 10
    assert result["logits_equal"] and result["generation_equal"], result


# ---- worker processes (tensor parallelism) ------------------------------------------------------
# A Ctrl-C in a terminal or a notebook reaches the user's whole process group, vLLM's worker
# processes included. The child runs in a session of its own, and each SIGINT goes to that group,
# as a terminal sends it: from the parent when a hook in a worker prints "SIGNAL ME <n>", or from
# a thread of the child where no hook can say when (a compiled engine).

TENSOR_PARALLEL_CHILD = r"""
import gc, json, os, signal, sys, threading, time
import torch
from vlens import HookedVLLM
from vlens.testing.tiny import tiny_model

# two ranks, unless the suite's engine arguments say otherwise (one GPU: one rank in a worker
# process of its own, with distributed_executor_backend="mp")
ENGINE_ARGS = {"tensor_parallel_size": 2, **json.loads(sys.argv[1])}
PROMPTS = ["An interrupted call", "leaves the engine serving"]
NAMES = ["blocks.0.hook_resid_post", "blocks.1.attn.hook_z"]

def report(scenario, **facts):
    print("RESULT " + json.dumps({"scenario": scenario, **facts}), flush=True)

def memory_blocks_of_workers():
    count = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().rsplit(")", 1)[1].split()[1] != str(os.getpid()):
                    continue
            links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:
            continue
        count += sum("memfd:vlens-kept-rows" in link for link in links)
    return count

if __name__ == "__main__":
    eager = HookedVLLM.from_pretrained(tiny_model("llama"), dtype="float32", **ENGINE_ARGS)
    def greedy_text(model, prompts=PROMPTS):
        return model.generate(prompts, max_new_tokens=8, do_sample=False, verbose=False)
    reference_text = greedy_text(eager)

    # 1. One Ctrl-C while an eager generation decodes; its hook runs in the worker processes.
    decoding = []
    def announce_decoding(value, hook):
        decoding.append(hook.is_prefill)
        if decoding.count(False) == 3 and torch.distributed.get_rank() == 0:
            print("SIGNAL ME 1", flush=True)
        time.sleep(0.01)
    try:
        eager.generate(PROMPTS * 2, max_new_tokens=400, do_sample=False, verbose=False,
                       fwd_hooks=[("blocks.0.hook_resid_post", announce_decoding)])
        raised = None
    except KeyboardInterrupt:
        raised = "KeyboardInterrupt"
    report("eager", raised=raised, generation_equal=greedy_text(eager) == reference_text)

    # 2. One Ctrl-C halfway through a compiled call whose rows stream into shared memory.
    compiled = HookedVLLM.from_pretrained(tiny_model("llama"), dtype="float32",
                                          compiled_capture=NAMES, **ENGINE_ARGS)
    def cache_of(prompts=PROMPTS, max_new_tokens=8):
        return compiled.run_with_cache(prompts, names_filter=NAMES, max_new_tokens=max_new_tokens)[1]
    reference = {name: tensor.clone() for name, tensor in cache_of().items()}
    start = time.monotonic()
    cache_of(PROMPTS * 16, 400)
    seconds = time.monotonic() - start
    gc.collect()
    blocks_before = memory_blocks_of_workers()
    def signal_once_running(requests=compiled.engine.llm.llm_engine.output_processor.request_states):
        while not requests:  # the call's requests reached vLLM
            time.sleep(0.002)
        time.sleep(seconds / 4)
        os.killpg(os.getpgrp(), signal.SIGINT)  # from here: a busy parent may answer late
    threading.Thread(target=signal_once_running, daemon=True).start()
    try:
        cache_of(PROMPTS * 16, 400)
        raised = None
    except KeyboardInterrupt:
        raised = "KeyboardInterrupt"
    equal = []
    for _ in range(3):
        cache = cache_of()
        equal.append(all(torch.equal(cache[name], reference[name]) for name in NAMES))
        del cache
        gc.collect()
    report("compiled", raised=raised, cache_equal=all(equal), full_call_seconds=seconds,
           blocks_before=blocks_before, blocks_after=memory_blocks_of_workers())

    # 3. Two Ctrl-Cs within one slow step: the second stops the wait at once.
    slowed = []
    def slow_step(value, hook):
        if not hook.is_prefill and not slowed and torch.distributed.get_rank() == 0:
            slowed.append(hook.name)
            print("SIGNAL ME 2", flush=True)
            time.sleep(20)
    start = time.monotonic()
    try:
        eager.generate(PROMPTS, max_new_tokens=4, do_sample=False, verbose=False,
                       fwd_hooks=[("blocks.0.hook_resid_post", slow_step)])
        raised = None
    except KeyboardInterrupt:
        raised = "KeyboardInterrupt"
    seconds = time.monotonic() - start
    try:
        greedy_text(eager)
        message = ""
    except RuntimeError as refusal:
        message = str(refusal)
    report("forced", raised=raised, seconds=seconds, message=message)
"""


@pytest.fixture(scope="module")
def tensor_parallel_scenarios(engine_args) -> dict[str, dict]:
    """Run the tensor-parallel child once, interrupting it where it asks; its results by
    scenario."""
    child = subprocess.Popen(
        [sys.executable, "-c", TENSOR_PARALLEL_CHILD, json.dumps(engine_args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, signalled whole as by a terminal
        preexec_fn=as_a_terminal_starts_it,
    )
    results = []
    try:
        for line in child.stdout:
            if "SIGNAL ME" in line:
                for _ in range(int(line.split("SIGNAL ME")[1].split()[0])):
                    os.killpg(child.pid, signal.SIGINT)
                    time.sleep(0.5)
            elif line.startswith("RESULT "):
                results.append(json.loads(line[7:]))
        _, stderr = child.communicate(timeout=400)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        _, stderr = child.communicate()
        pytest.fail(f"the engine hung after an interrupt:\n{stderr[-3000:]}")
    assert len(results) == 3, stderr[-3000:]
    return {result["scenario"]: result for result in results}


def test_ctrl_c_during_a_tensor_parallel_generation_leaves_the_workers_serving(
    tensor_parallel_scenarios,
):
    result = tensor_parallel_scenarios["eager"]
    assert result["raised"] == "KeyboardInterrupt"
    assert result["generation_equal"], result


def test_ctrl_c_during_a_streamed_tensor_parallel_call_gives_its_memory_back(
    tensor_parallel_scenarios,
):
    """The interrupted call's rows were streaming into the workers' shared memory: the next
    calls' caches are exact, and they reuse that memory rather than taking more."""
    result = tensor_parallel_scenarios["compiled"]
    assert result["raised"] == "KeyboardInterrupt", result
    assert result["cache_equal"], result
    assert 0 < result["blocks_after"] <= result["blocks_before"], result


def test_a_second_ctrl_c_stops_a_slow_step_at_once_and_the_engine_says_to_rebuild(
    tensor_parallel_scenarios,
):
    result = tensor_parallel_scenarios["forced"]
    assert result["raised"] == "KeyboardInterrupt"
    assert result["seconds"] < 15, result  # the step's hook sleeps 20 s
    assert "build a new one with HookedVLLM.from_pretrained" in result["message"], result
    assert "second Ctrl-C" in result["message"], result


# ---- WorkerWaits alone ----------------------------------------------------------------------------


def test_a_ctrl_c_while_waiting_on_workers_is_raised_when_the_wait_ends(sigint_raises):
    waits = WorkerWaits()
    after_signal = []
    with pytest.raises(KeyboardInterrupt), waits.wait():
        signal.raise_signal(signal.SIGINT)
        after_signal.append("the wait went on")
    assert after_signal == ["the wait went on"] and not waits.lost_answer
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_second_ctrl_c_while_waiting_on_workers_is_raised_at_once(sigint_raises):
    waits = WorkerWaits()
    after_signal = []
    with pytest.raises(KeyboardInterrupt) as raised, waits.wait():
        signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGINT)
        after_signal.append("the wait went on")
    assert after_signal == [] and waits.lost_answer
    assert raised.value.__context__ is None  # raised once, not again when the wait ended
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_wait_keeps_the_users_own_sigint_handler_and_calls_it_once():
    calls = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: calls.append(signum))
    try:
        with WorkerWaits().wait():
            signal.raise_signal(signal.SIGINT)
            assert calls == []
        assert calls == [signal.SIGINT]
    finally:
        signal.signal(signal.SIGINT, previous)
