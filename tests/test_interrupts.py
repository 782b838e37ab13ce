"""An interrupted call leaves the engine serving, and a hook cannot call the model again.

The scenarios run in one child process on one engine: a regression here hangs vLLM's step loop
forever, and the child's time limit turns that into a failure instead of a stuck suite.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest

CHILD = r"""
import json, sys, time
import torch
from vlens import HookedVLLM
from vlens.testing import tiny_model

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
