"""`vlens serve` as a child process on tiny Llama, through the official `openai` client: steering
and captures per request, each request's result as if it ran alone, a 400 for every bad field,
the held captures' bound, the API key, and lm-eval scoring a steered model."""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import torch
from safetensors.torch import load, save_file

from vlens import Steer
from vlens.sae import SAE
from vlens.serve.process import free_port, server_process, settled
from vlens.testing.saes import random_sae
from vlens.testing.tiny import tiny_model

HERE = Path(__file__).parent / "data"
KEY = "vlens-test-key"
CAPTURE_BYTES = 64 * 1024
STEERED = "blocks.1.hook_resid_post"
SAE_AT = "blocks.0.hook_resid_post"


@pytest.fixture(scope="module")
def up(hooked) -> torch.Tensor:
    """The server's registered vector "up" (a random d_model direction, large enough to change
    the tiny model's greedy tokens at scale 6)."""
    return torch.randn(hooked("llama").cfg.d_model, generator=torch.Generator().manual_seed(11))


@pytest.fixture(scope="module")
def server(tmp_path_factory, up, engine_args):
    folder = tmp_path_factory.mktemp("serve")
    save_file({"up": up}, str(folder / "vectors.safetensors"))
    port = free_port()
    command = [
        sys.executable, "-m", "vlens.cli", "serve", str(tiny_model("llama")),
        "--port", str(port), "--dtype", "float32", "--max-model-len", "256",
        "--kv-cache-memory-bytes", str(engine_args["kv_cache_memory_bytes"]),
        "--api-key", KEY, "--chat-template", str(HERE / "chat_template.jinja"),
        "--vectors", str(folder / "vectors.safetensors"),
        "--steered-model", f"steered={HERE / 'steered.json'}",
        "--capture-bytes", str(CAPTURE_BYTES),
    ]
    with server_process(command, port, folder / "server.log", api_key=KEY) as base:
        yield base


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server, api_key=KEY, max_retries=0, timeout=120)


MODEL = str(tiny_model("llama"))
GREEDY = dict(model=MODEL, max_tokens=8, temperature=0.0)


def complete(client: openai.OpenAI, prompt: list[int], vlens: dict | None = None, **options):
    body = {"ignore_eos": True, "return_token_ids": True}
    if vlens is not None:
        body["vlens"] = vlens
    return client.completions.create(prompt=prompt, **{**GREEDY, **options}, extra_body=body)


def new_tokens(response) -> list[int]:
    return list(response.choices[0].model_extra["token_ids"])


def prompt_of(seed: int, length: int = 7) -> list[int]:
    return torch.randint(3, 500, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_a_steered_and_a_plain_completion_in_one_batch_equal_generate(client, hooked, up):
    model = hooked("llama")
    prompts = [prompt_of(1), prompt_of(2)]
    steer = {"steering": [{"name": STEERED, "add": "up", "scale": 6.0, "positions": [3, None]}]}
    with ThreadPoolExecutor(2) as pool:
        steered, plain = pool.map(
            lambda job: complete(client, *job), [(prompts[0], steer), (prompts[1], None)]
        )
    expected = model.generate(
        prompts, max_new_tokens=8, do_sample=False, stop_at_eos=False, return_type="input",
        prompt_steering=[[Steer(STEERED, add=up, scale=6.0, positions=slice(3, None))], []],
    )
    assert prompts[0] + new_tokens(steered) == expected[0]
    assert prompts[1] + new_tokens(plain) == expected[1]
    unsteered = model.generate(prompts[0], max_new_tokens=8, do_sample=False, stop_at_eos=False,
                               return_type="input")
    assert expected[0] != unsteered[0]  # the steering changed the tokens


def test_concurrent_clients_with_different_vectors_get_their_solo_results(client, hooked):
    d_model = hooked("llama").cfg.d_model
    jobs = []
    for index in range(32):
        vector = torch.randn(d_model, generator=torch.Generator().manual_seed(100 + index))
        steer = {"steering": [{"name": STEERED, "add": vector.tolist(), "scale": 6.0}]}
        jobs.append((prompt_of(200 + index), steer if index % 4 else None))
    solo = [new_tokens(complete(client, *job)) for job in jobs]
    with ThreadPoolExecutor(32) as pool:
        together = [new_tokens(response) for response in pool.map(lambda j: complete(client, *j), jobs)]
    assert together == solo
    assert len({tuple(tokens) for tokens in solo}) > 16  # the vectors steer differently


def fetch(server: str, activation_id: str) -> bytes:
    request = urllib.request.Request(
        f"{server}/activations/{activation_id}", headers={"Authorization": f"Bearer {KEY}"}
    )
    with urllib.request.urlopen(request) as response:
        return response.read()


CAPTURED = ["blocks.0.hook_resid_post", "blocks.1.attn.hook_pattern", "blocks.1.attn.hook_z",
            "blocks.0.mlp.hook_post", "blocks.1.hook_resid_mid", "ln_final.hook_normalized"]


def test_captured_activations_equal_run_with_cache_and_huggingface(client, server, hooked, bridge):
    prompt = prompt_of(3, length=9)
    response = complete(client, prompt, {"capture": CAPTURED}, max_tokens=4)
    info = response.model_extra["vlens"]
    assert info == response.choices[0].model_extra["vlens"]
    values = load(fetch(server, info["activations"]))
    assert sorted(values) == sorted(CAPTURED)
    assert {name: list(value.shape) for name, value in values.items()} == info["names"]
    _, cache = hooked("llama").run_with_cache(prompt, names_filter=CAPTURED, max_new_tokens=4)
    sampled = new_tokens(response)
    assert cache.tokens[0].tolist() == prompt + sampled[:-1]
    _, reference = bridge("llama").run_with_cache(cache.tokens)
    for name in CAPTURED:
        # the same model and kernels as run_with_cache, in another process: equal to float
        # noise. 1e-5, not 1e-6: the server's CPU kernels may split their sums over other
        # threads than this process's (2.6e-6 seen here once test_compiled's engines had run
        # in this process first; 0 when they had not), which a misplaced row would exceed
        # by orders of magnitude
        torch.testing.assert_close(values[name], cache[name][0], rtol=0, atol=1e-5, msg=name)
        # HuggingFace through TransformerLens's bridge: the parity suite's limit
        torch.testing.assert_close(values[name], reference[name][0].float(), rtol=1e-4,
                                   atol=1e-4, msg=name)
    with pytest.raises(urllib.error.HTTPError, match="404"):  # served once
        fetch(server, info["activations"])


BAD_FIELDS = [
    ({"capture": ["blocks.0.hook_resid_pots"]}, "Did you mean: blocks.0.hook_resid_post"),
    ({"steering": [{"name": STEERED, "add": [1.0, 2.0]}]}, "has 2 elements"),
    ({"steering": [{"name": STEERED, "add": [float("nan")] * 128}]}, "non-finite"),
    ({"steering": [{"name": STEERED, "gain": [1.0, float("inf")]}]}, "non-finite"),
    ({"steering": [{"name": "blocks.0.attn.hook_pattern", "gain": 2.0}]}, "hook_pattern"),
    ({"steering": [{"name": STEERED, "add": "down"}]}, "no vector named 'down'; the server has: up"),
    ({"steering": [{"name": STEERED}]}, "changes nothing"),
    ({"steering": [{"name": STEERED, "add": "up", "positions": [-2, None]}]}, "count forward"),
    ({"capture": "blocks.0.hook_resid_post"}, "must be a list of hook names"),
    ({"steer": []}, "unknown field"),
    ([1, 2], "must be an object"),
]


@pytest.mark.parametrize("fields, message", BAD_FIELDS, ids=[m for _, m in BAD_FIELDS])
def test_a_bad_vlens_field_is_a_400_that_names_it(client, server, fields, message):
    if "non-finite" in message:
        # JSON has no NaN or infinity; Python's json (and so a careless client) writes them
        # anyway as NaN / Infinity, which the openai client refuses to send: sent raw here.
        body = json.dumps({**GREEDY, "prompt": prompt_of(4), "vlens": fields}).encode()
        request = urllib.request.Request(
            f"{server}/completions", data=body,
            headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
        )
        with pytest.raises(urllib.error.HTTPError) as raised:
            urllib.request.urlopen(request)
        assert raised.value.code == 400
        assert message in json.loads(raised.value.read())["error"]["message"]
        return
    with pytest.raises(openai.BadRequestError) as raised:
        complete(client, prompt_of(4), fields)
    assert message in str(raised.value)


def test_a_streamed_completion_is_steered_and_captured_as_a_whole_one(client, server):
    fields = {"steering": [{"name": STEERED, "add": "up", "scale": 6.0}],
              "capture": ["blocks.1.hook_resid_post"]}
    whole = complete(client, prompt_of(7), fields)
    chunks = list(complete(client, prompt_of(7), fields, stream=True))
    streamed = [t for chunk in chunks if chunk.choices for t in chunk.choices[0].model_extra["token_ids"]]
    assert streamed == new_tokens(whole)
    last = chunks[-1]  # no choices: the capture, as a whole response carries it
    assert not last.choices and last.model_extra["vlens"]["names"] == whole.model_extra["vlens"]["names"]
    streamed_values = load(fetch(server, last.model_extra["vlens"]["activations"]))
    whole_values = load(fetch(server, whole.model_extra["vlens"]["activations"]))
    assert torch.equal(streamed_values["blocks.1.hook_resid_post"], whole_values["blocks.1.hook_resid_post"])


def test_what_vlens_fields_cannot_combine_with_is_a_400_and_the_server_keeps_serving(client):
    capture = {"capture": ["blocks.0.hook_resid_post"]}
    with pytest.raises(openai.BadRequestError, match="takes n=1"):
        list(complete(client, prompt_of(5), capture, n=2, stream=True))
    with pytest.raises(openai.BadRequestError, match="takes one prompt"):
        complete(client, [prompt_of(5), prompt_of(6)], capture, stream=True)
    for key, value in (("vlens_tag", "serve-0:0"), ("vlens_fields", "0" * 32)):
        with pytest.raises(openai.BadRequestError, match="reserved"):  # posing as another request
            client.completions.create(prompt=prompt_of(5), **GREEDY,
                                      extra_body={"vllm_xargs": {key: value}})
    assert len(new_tokens(complete(client, prompt_of(5), capture))) == 8


def test_n_samples_are_each_steered_and_captured_as_requests_of_their_own(client, server):
    """``n`` samples with vlens fields: sample ``i`` is the request alone with seed ``seed + i``
    (vLLM's own rule for n > 1), steered, with its own capture; in completions and chat."""
    fields = {"steering": [{"name": STEERED, "add": "up", "scale": 6.0}],
              "capture": ["blocks.1.hook_resid_post"]}
    sampling = dict(temperature=1.0, max_tokens=8)
    together = complete(client, prompt_of(8), fields, n=3, seed=5, **sampling)
    alone = [complete(client, prompt_of(8), fields, seed=5 + i, **sampling) for i in range(3)]
    plain = complete(client, prompt_of(8), None, n=3, seed=5, **sampling)
    assert [choice.index for choice in together.choices] == [0, 1, 2]
    tokens = [list(choice.model_extra["token_ids"]) for choice in together.choices]
    assert tokens == [new_tokens(response) for response in alone]
    assert len({tuple(sample) for sample in tokens}) > 1  # the samples differ
    assert tokens != [list(choice.model_extra["token_ids"]) for choice in plain.choices]
    for choice, single in zip(together.choices, alone, strict=True):
        got = load(fetch(server, choice.model_extra["vlens"]["activations"]))
        expected = load(fetch(server, single.model_extra["vlens"]["activations"]))
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)  # other batches
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], n=2, seed=3,
        extra_body={"ignore_eos": True, "vlens": fields}, **sampling)
    assert [choice.index for choice in chat.choices] == [0, 1]
    captures = [choice.model_extra["vlens"]["activations"] for choice in chat.choices]
    assert len(set(captures)) == 2


def test_chat_completions_steer_and_capture(client, server, hooked, up):
    messages = [{"role": "user", "content": "hello there"}]
    fields = {"steering": [{"name": STEERED, "add": "up", "scale": 6.0}],
              "capture": ["blocks.0.hook_resid_post"]}
    options = dict(model=MODEL, messages=messages, max_tokens=6, temperature=0.0)
    body = {"ignore_eos": True, "return_token_ids": True}
    steered = client.chat.completions.create(**options, extra_body={**body, "vlens": fields})
    plain = client.chat.completions.create(**options, extra_body=body)
    prompt = list(steered.model_extra["prompt_token_ids"])
    tokens = list(steered.choices[0].model_extra["token_ids"])
    expected = hooked("llama").generate(
        prompt, max_new_tokens=6, do_sample=False, stop_at_eos=False, return_type="input",
        steering=[Steer(STEERED, add=up, scale=6.0)],
    )
    assert prompt + tokens == expected[0]
    assert tokens != list(plain.choices[0].model_extra["token_ids"])
    values = load(fetch(server, steered.model_extra["vlens"]["activations"]))
    assert values["blocks.0.hook_resid_post"].shape == (len(prompt) + 5, hooked("llama").cfg.d_model)


def test_the_activation_store_stays_within_its_bound(client, server, hooked):
    """Each capture is ~36 KB; the server holds 64 KiB: every capture past the first drops the one
    before it, unfetched, so only the last is left."""
    names = ["blocks.0.hook_resid_post", "blocks.1.hook_resid_post"]
    ids = []
    for index in range(6):
        response = complete(client, prompt_of(300 + index, length=30), {"capture": names})
        ids.append(response.model_extra["vlens"]["activations"])
    for activation_id in ids[:-1]:
        with pytest.raises(urllib.error.HTTPError, match="404"):
            fetch(server, activation_id)
    assert 30_000 < len(fetch(server, ids[-1])) <= CAPTURE_BYTES


def assert_forgotten(server: str) -> None:
    now = settled(server, KEY)
    assert all(not any(counts.values()) for counts in now["workers"]), now
    assert now["tickets"] == 0, now
    assert now["captures"]["bytes"] <= now["captures"]["max_bytes"], now


def test_a_client_leaving_mid_stream_leaves_nothing_behind(client, server, hooked):
    """A steered, capturing stream whose client disconnects after a few events: the workers
    forget the request, its plan is released, and the next requests get their solo results."""
    import httpx

    fields = {"steering": [{"name": STEERED, "add": "up", "scale": 6.0}],
              "capture": ["blocks.1.hook_resid_post"]}
    expected = new_tokens(complete(client, prompt_of(8), fields))
    body = {**GREEDY, "prompt": prompt_of(9), "max_tokens": 200, "stream": True,
            "ignore_eos": True, "vlens": fields}
    for _ in range(3):
        with httpx.stream("POST", f"{server}/completions", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {KEY}"}) as response:
            assert response.status_code == 200
            events = response.iter_lines()
            for _ in range(3):
                next(events)
    assert_forgotten(server)
    assert new_tokens(complete(client, prompt_of(8), fields)) == expected


def test_a_request_cancelled_while_steered_leaves_nothing_behind(client, server):
    """A client that gives up on a steered request (its timeout) aborts it in vLLM."""
    fields = {"steering": [{"name": STEERED, "add": "up", "scale": 6.0}],
              "capture": ["blocks.0.hook_resid_post"]}
    impatient = openai.OpenAI(base_url=server, api_key=KEY, max_retries=0, timeout=0.5)
    for index in range(3):
        with pytest.raises(openai.APITimeoutError):
            complete(impatient, prompt_of(10 + index), fields, max_tokens=240)
    assert_forgotten(server)
    assert complete(client, prompt_of(8), fields).choices[0].finish_reason == "length"


def test_captures_larger_than_the_store_are_refused_and_leave_nothing(client, server):
    """Each capture takes more than the server holds: a 400 that says so and how to fix it, the
    server and its workers hold nothing more after, and the server keeps serving."""
    before = settled(server, KEY)["captures"]
    names = ["blocks.0.hook_resid_post", "blocks.1.hook_resid_post", "blocks.2.hook_resid_post",
             "blocks.0.mlp.hook_post"]
    for index in range(5):
        with pytest.raises(openai.BadRequestError, match=r"more than the server's whole "
                           r"bound for held captures.*--capture-bytes"):
            complete(client, prompt_of(20 + index, length=100), {"capture": names}, max_tokens=40)
    assert_forgotten(server)
    assert settled(server, KEY)["captures"]["bytes"] <= before["bytes"]
    small = complete(client, prompt_of(30), {"capture": ["blocks.0.hook_resid_post"]})
    assert "activations" in small.model_extra["vlens"]


def test_an_activation_id_guessed_or_fetched_twice_is_a_404_that_says_why(client, server):
    response = complete(client, prompt_of(40), {"capture": ["blocks.0.hook_resid_post"]})
    activation_id = response.model_extra["vlens"]["activations"]
    assert len(fetch(server, activation_id)) > 0
    for wrong in (activation_id, "0" * 22, activation_id[:-1]):
        with pytest.raises(urllib.error.HTTPError) as refused:
            fetch(server, wrong)
        assert refused.value.code == 404
        message = json.loads(refused.value.read())["error"]["message"]
        assert "each is served once" in message
    with pytest.raises(urllib.error.HTTPError, match="404"):  # no route outside those held
        fetch(server, urllib.parse.quote("../../etc/passwd", safe=""))


def test_the_api_key_guards_completions_and_activations(server):
    for path in ("/completions", "/activations/anything"):
        request = urllib.request.Request(f"{server}{path}", method="GET")
        with pytest.raises(urllib.error.HTTPError, match="401"):
            urllib.request.urlopen(request)


# ---- lm-eval through local-completions --------------------------------------------------------

TASK = """task: vlens_tiny_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {items}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""


def lm_eval_log_likelihoods(server: str, model: str, tasks: Path,
                            task: str = "vlens_tiny_choice") -> tuple[object, list]:
    """lm-eval's local-completions against the server: the model object (its tokenization) and
    each (context, continuation) it scored with the log-likelihood it got."""
    from lm_eval import simple_evaluate
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    lm = LocalCompletionsAPI(
        model=model, base_url=f"{server}/completions", tokenizer=MODEL,
        tokenizer_backend="huggingface", max_length=256, num_concurrent=1,
    )
    results = simple_evaluate(
        model=lm, tasks=[task], task_manager=TaskManager(include_path=str(tasks)),
        log_samples=True,
    )
    scored = []
    for sample in results["samples"][task]:
        for (context, continuation), response in zip(sample["arguments"], sample["resps"]):
            scored.append((context, continuation, float(response[0][0])))
    return lm, scored


def test_lm_eval_scores_the_steered_model_as_vlens_computes_it(server, hooked, up, tmp_path,
                                                                monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    (tmp_path / "task.yaml").write_text(TASK.format(items=HERE / "items.jsonl"))
    model = hooked("llama")
    steering = [Steer(STEERED, add=up, scale=6.0)]
    totals = {}
    for served_name, steers in ((MODEL, []), ("steered", steering)):
        lm, scored = lm_eval_log_likelihoods(server, served_name, tmp_path)
        assert len(scored) == 10  # every choice of every item
        for context, continuation, log_likelihood in scored:
            context_tokens, continuation_tokens = lm._encode_pair(context, continuation)
            tokens = torch.tensor(context_tokens + continuation_tokens)
            logits = model.run_with_cache(tokens, names_filter=[], steering=steers)[0][0]
            log_probs = logits.float().log_softmax(-1)
            targets = range(len(context_tokens), len(tokens))
            expected = sum(float(log_probs[i - 1, tokens[i]]) for i in targets)
            assert log_likelihood == pytest.approx(expected, abs=1e-4), (context, continuation)
        totals[served_name] = sum(score for *_, score in scored)
    assert abs(totals["steered"] - totals[MODEL]) > 1e-2  # the steered model scores differently


def prefix_cache_hits(server: str) -> float:
    """The server's count of prompt tokens read from vLLM's prefix cache so far."""
    with urllib.request.urlopen(server.removesuffix("/v1") + "/metrics", timeout=30) as answer:
        text = answer.read().decode()
    counts = [float(line.split()[-1]) for line in text.splitlines()
              if line.startswith("vllm:prefix_cache_hits_total")]
    assert counts, "the server exposes no vllm:prefix_cache_hits_total"
    return sum(counts)


def test_lm_eval_with_a_shared_prefix_scores_as_without_the_cache(server, hooked, up, tmp_path,
                                                                   monkeypatch):
    """A task whose every context starts with one long description (more than a KV block),
    scored by the steered model, whose requests may share cached blocks: lm-eval's requests ask
    for prompt logprobs, for which vLLM reads no cached block (it would have no logprobs for
    those positions), and vlens keeps it so; the scores are what an engine without a prefix
    cache computes."""
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    description = "The quick brown fox jumps over the lazy dog. " * 6  # ~140 tokens
    task = TASK.format(items=HERE / "items.jsonl").replace("vlens_tiny_choice", "vlens_shared")
    (tmp_path / "task.yaml").write_text(f'{task}description: "{description}"\n')
    before = prefix_cache_hits(server)
    lm, scored = lm_eval_log_likelihoods(server, "steered", tmp_path, task="vlens_shared")
    assert len(scored) == 10 and prefix_cache_hits(server) == before
    uncached = hooked("llama", enable_prefix_caching=False)
    steering = [Steer(STEERED, add=up, scale=6.0)]
    for context, continuation, log_likelihood in scored:
        context_tokens, continuation_tokens = lm._encode_pair(context, continuation)
        tokens = torch.tensor(context_tokens + continuation_tokens)
        logits = uncached.run_with_cache(tokens, names_filter=[], steering=steering)[0][0]
        log_probs = logits.float().log_softmax(-1)
        expected = sum(float(log_probs[i - 1, tokens[i]])
                       for i in range(len(context_tokens), len(tokens)))
        assert log_likelihood == pytest.approx(expected, abs=1e-4), (context, continuation)


# ---- the compiled engine ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compiled_server(tmp_path_factory, engine_args):
    folder = tmp_path_factory.mktemp("serve-compiled")
    port = free_port()
    command = [
        sys.executable, "-m", "vlens.cli", "serve", str(tiny_model("llama")),
        "--port", str(port), "--dtype", "float32", "--max-model-len", "256",
        "--kv-cache-memory-bytes", str(engine_args["kv_cache_memory_bytes"]),
        "--compiled-steering", STEERED, "--compiled-capture", "blocks.0.hook_resid_post",
        "--sae", f"std={random_sae(folder / 'sae', d_in=128, d_sae=48, hook_name=SAE_AT, seed=5)}",
        "--sae-top-k", "4", "--sae-slots", "6",
    ]
    with server_process(command, port, folder / "server.log") as base:
        yield base


def test_a_compiled_server_steers_and_captures_in_its_graph(compiled_server, hooked):
    client = openai.OpenAI(base_url=compiled_server, api_key="none", max_retries=0, timeout=120)
    model = hooked("llama")
    vector = torch.randn(model.cfg.d_model, generator=torch.Generator().manual_seed(12))
    prompt = prompt_of(6)
    fields = {"steering": [{"name": STEERED, "add": vector.tolist(), "scale": 6.0}],
              "capture": ["blocks.0.hook_resid_post"]}
    response = complete(client, prompt, fields)
    expected = model.generate(prompt, max_new_tokens=8, do_sample=False, stop_at_eos=False,
                              return_type="input", steering=[Steer(STEERED, add=vector, scale=6.0)])
    assert prompt + new_tokens(response) == expected[0]
    values = load(fetch(compiled_server, response.model_extra["vlens"]["activations"]))
    _, cache = model.run_with_cache(prompt, names_filter="blocks.0.hook_resid_post", max_new_tokens=8,
                                    steering=[Steer(STEERED, add=vector, scale=6.0)])
    # Inductor's fused graph against the eager forward: fp32 rounding
    torch.testing.assert_close(values["blocks.0.hook_resid_post"],
                               cache["blocks.0.hook_resid_post"][0], rtol=1e-5, atol=1e-5)
    for fields, message in (
        ({"steering": [{"name": "blocks.0.hook_resid_post", "gain": 2.0}]}, "compiled_steering"),
        ({"capture": ["blocks.1.hook_resid_post"]}, "compiled"),
    ):
        with pytest.raises(openai.BadRequestError, match=message):
            complete(client, prompt, fields)


def test_compiled_plans_travel_inside_the_request(compiled_server, hooked, tmp_path):
    """On a compiled engine, a request that steers (a vector, an SAE's features) reaches the
    workers inside the request, with no call of its own, and one that also captures traced names
    with one call only (its rows' hand-back): the tokens of generate; every worker forgets both
    once they finish."""
    client = openai.OpenAI(base_url=compiled_server, api_key="none", max_retries=0, timeout=120)
    model = hooked("llama")
    calls = settled(compiled_server)["worker_calls"]
    steer_fields = {"steering": [{"name": STEERED, "add": [0.5] * model.cfg.d_model}]}
    complete(client, prompt_of(3), steer_fields)
    complete(client, prompt_of(4), {**steer_fields, "capture": ["blocks.0.hook_resid_post"]})
    now = settled(compiled_server)["worker_calls"]
    assert now.get("prepare", 0) == calls.get("prepare", 0), (calls, now)
    assert now.get("finish", 0) == calls.get("finish", 0) + 1, (calls, now)
    vector = torch.randn(model.cfg.d_model, generator=torch.Generator().manual_seed(13))
    prompts = [prompt_of(20 + i) for i in range(6)]
    fields = {"steering": [{"name": STEERED, "add": vector.tolist(), "scale": 6.0,
                            "positions": [4, None]}]}
    with ThreadPoolExecutor(6) as pool:
        responses = list(pool.map(lambda p: complete(client, p, fields), prompts))
    steer = Steer(STEERED, add=vector, scale=6.0, positions=slice(4, None))
    expected = model.generate(prompts, max_new_tokens=8, do_sample=False, stop_at_eos=False,
                              return_type="input", steering=[steer])
    assert [p + new_tokens(r) for p, r in zip(prompts, responses)] == expected
    assert expected != model.generate(prompts, max_new_tokens=8, do_sample=False,
                                      stop_at_eos=False, return_type="input")
    assert all(r.model_extra.get("vlens") is None for r in responses)  # nothing captured
    sae = SAE.load_from_disk(random_sae(tmp_path / "sae", d_in=128, d_sae=48, hook_name=SAE_AT,
                                        seed=5))
    response = complete(client, prompts[0], {"steering": [{"sae": "std", "features": [7, 8],
                                                           "scale": [0.0, 5.0]}]})

    def edit(acts: torch.Tensor, hook) -> None:
        acts[..., 7] = 0.0
        acts[..., 8] *= 5.0

    with model.saes(saes=[sae], use_error_term=True):
        expected = model.generate(prompts[0], max_new_tokens=8, do_sample=False,
                                  stop_at_eos=False, return_type="input",
                                  fwd_hooks=[(f"{SAE_AT}.hook_sae_acts_post", edit)])
    assert prompts[0] + new_tokens(response) == expected[0]
    assert_forgotten(compiled_server)


def test_a_compiled_server_edits_sae_features_and_captures_the_top_k(
    compiled_server, hooked, tmp_path
):
    """``--sae``: a request's feature clamp equals the eager engine's spliced SAE with a hook
    clamping the feature; the top-k features come back as captures."""
    client = openai.OpenAI(base_url=compiled_server, api_key="none", max_retries=0, timeout=120)
    model = hooked("llama")
    sae = SAE.load_from_disk(random_sae(tmp_path / "sae", d_in=128, d_sae=48, hook_name=SAE_AT,
                                        seed=5))
    prompt = prompt_of(8)
    top_k = [f"{SAE_AT}.hook_sae_acts_post.top_k_values", f"{SAE_AT}.hook_sae_acts_post.top_k_indices"]
    fields = {"steering": [{"sae": "std", "features": [7], "clamp": 30.0, "positions": [3, None]}],
              "capture": [SAE_AT, *top_k]}
    response = complete(client, prompt, fields)

    def clamp(acts: torch.Tensor, hook) -> None:
        acts[..., 7] = torch.where(hook.positions >= 3, 30.0, acts[..., 7])

    with model.saes(saes=[sae], use_error_term=True):
        expected = model.generate(prompt, max_new_tokens=8, do_sample=False, stop_at_eos=False,
                                  return_type="input",
                                  fwd_hooks=[(f"{SAE_AT}.hook_sae_acts_post", clamp)])
    assert prompt + new_tokens(response) == expected[0]
    assert new_tokens(response) != new_tokens(complete(client, prompt)), "the clamp did nothing"
    values = load(fetch(compiled_server, response.model_extra["vlens"]["activations"]))
    # before position 3 the SAE's features of the activation; from it on (where the activation
    # holds the edit) feature 7 clamped, first
    top = sae.encode(values[SAE_AT][:3]).topk(4, dim=-1)
    torch.testing.assert_close(values[top_k[0]][:3], top.values, rtol=1e-5, atol=1e-5)
    assert torch.equal(values[top_k[1]][:3].long(), top.indices)
    assert torch.all(values[top_k[1]][3:, 0] == 7) and torch.all(values[top_k[0]][3:, 0] == 30.0)
    for fields, message in (
        ({"steering": [{"sae": "nope", "features": [1], "clamp": 1.0}]}, "no SAE of that name"),
        ({"steering": [{"sae": "std", "features": list(range(7)), "clamp": 1.0}]},
         "compiled_sae_slots=7"),
        ({"steering": [{"sae": "std", "features": [1], "clamp": 1.0, "scale": 2.0}]}, "no scale"),
        ({"steering": [{"sae": "std", "features": ["a"], "clamp": 1.0}]}, "feature indices"),
    ):
        with pytest.raises(openai.BadRequestError, match=message):
            complete(client, prompt, fields)


# ---- the held captures and the fields, without a server ------------------------------------------------


def test_the_store_drops_the_oldest_and_refuses_what_it_cannot_hold():
    from vlens.serve.captures import HeldCaptures

    store = HeldCaptures(3000)
    ids = [store.put({"x": torch.full((100,), float(i))}) for i in range(8)]  # 472 bytes each
    assert store.size <= 3000 and store.take(ids[0]) is None
    assert load(store.take(ids[-1]))["x"][0] == 7.0
    assert store.take(ids[-1]) is None  # taken once
    with pytest.raises(ValueError, match="--capture-bytes"):
        store.put({"x": torch.zeros(1000)})


def test_steering_fields_read_into_steers():
    from vlens.serve.fields import read_fields

    up = torch.ones(4)
    fields = read_fields({"steering": [
        {"name": "a", "add": "up", "scale": 2, "positions": [1, None]},
        {"name": "b", "ablate": [1.0, 0.0], "gain": [2.0, 3.0]},
        {"name": "c", "gain": 0.5},
    ], "capture": ["d"]}, {"up": up})
    first, second, third = fields.steering
    assert first.add is up and first.scale == 2.0 and first.positions == slice(1, None)
    assert second.ablate.tolist() == [1.0, 0.0] and second.gain.tolist() == [2.0, 3.0]
    assert third.gain == 0.5 and fields.capture == ("d",)


@pytest.mark.parametrize("vector", [
    [1.0, True], [1.0, "2"], [1.0, None], [[1.0], [2.0]], [1.0, [2.0]], [],
], ids=["boolean", "string", "null", "nested", "ragged", "empty"])
def test_vector_fields_that_are_not_arrays_of_numbers_are_refused(vector):
    from vlens.serve.fields import BadVlensField, read_fields

    with pytest.raises(BadVlensField, match=r"vlens.steering\[0\].add must be a non-empty array"):
        read_fields({"steering": [{"name": "a", "add": vector}]}, {})


def test_a_vector_in_base64_is_the_vector_as_an_array():
    """``{"base64": ...}``: little-endian float32, as OpenAI's embeddings API encodes vectors
    (16 KB of text for a 4,096-wide vector instead of ~84 KB of JSON numbers)."""
    import base64

    import numpy as np

    from vlens.serve.fields import BadVlensField, read_fields

    vector = torch.randn(64, generator=torch.Generator().manual_seed(2))
    encoded = base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode()
    ours = read_fields({"steering": [{"name": "a", "add": {"base64": encoded}}]}, {})
    theirs = read_fields({"steering": [{"name": "a", "add": vector.tolist()}]}, {})
    assert torch.equal(ours.steering[0].add, theirs.steering[0].add)
    nan = base64.b64encode(np.array([1.0, np.nan], dtype="<f4").tobytes()).decode()
    for value, message in (({"base64": "not base64!"}, "is not base64"),
                           ({"base64": "AAAA", "dtype": "f2"}, "a vector object is"),
                           ({"base64": "AAA="}, "not a whole number of float32"),
                           ({"base64": nan}, "non-finite"),
                           ([1.0, 10**400], "too large")):
        with pytest.raises(BadVlensField, match=message):
            read_fields({"steering": [{"name": "a", "add": value}]}, {})


@pytest.mark.parametrize("options, message", [
    (["/nonexistent"], "is not a checkpoint folder"),
    ([MODEL, "--compiled-steering", "blocks.0.hook_resid_pots"], "Did you mean"),
], ids=["folder", "compiled name"])
def test_what_a_server_cannot_serve_is_refused_before_it_starts(options, message):
    import subprocess

    result = subprocess.run([sys.executable, "-m", "vlens.cli", "serve", *options],
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode != 0 and message in result.stderr.splitlines()[-1]
