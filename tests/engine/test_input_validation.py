"""What is not a prompt, or not a generation setting, is refused where it enters the API, with an
error naming what was given and what is accepted; what is one still runs."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

TEXT = "The cat sat on the mat"
#: Words every prompt error names: the accepted forms.
ACCEPTED = ("a str", "a list of str", "[pos] or [batch, pos]", "a list of lists of ints")

BAD_PROMPTS = {
    "dict": ({"text": TEXT}, TypeError, "a dict"),
    "bytes": (b"The cat", TypeError, "bytes"),
    "bool": (True, TypeError, "True"),
    "list of bools": ([True, False], TypeError, "True"),
    "bool tensor": (torch.tensor([True, False]), TypeError, "torch.bool tensor"),
    "int": (5, TypeError, "an int"),
    "None": (None, TypeError, "None"),
    "float": (2.5, TypeError, "a float"),
    "list of floats": ([1.0, 2.0], TypeError, "a float"),
    "float tensor": (torch.tensor([1.0, 2.0]), TypeError, "torch.float32 tensor"),
    "3-d tensor": (torch.ones(1, 1, 3, dtype=torch.long), ValueError, r"shape \(1, 1, 3\)"),
    "strings and ids": (["a", 1], TypeError, "mixes strings with an int"),
    "list of str lists": ([["a"]], TypeError, "a list holding a str"),
}


@pytest.fixture(scope="module")
def model(hooked):
    return hooked("qwen3")


def prompt_calls(model):
    """Every public way into the engine that takes a prompt, and the token methods."""
    return {
        "model": lambda x: model(x),
        "run_with_cache": lambda x: model.run_with_cache(x),
        "run_with_hooks": lambda x: model.run_with_hooks(x, fwd_hooks=[]),
        "generate": lambda x: model.generate(x, max_new_tokens=1),
        "to_tokens": lambda x: model.to_tokens(x),
        "token_lists": lambda x: model.token_lists(x),
    }


def raises_naming(error: type[Exception], given: str, call, *accepted: str) -> None:
    """``call()`` raises ``error`` with a message naming what was ``given`` (a regex) and each of
    the ``accepted`` forms."""
    with pytest.raises(error, match=given) as raised:
        call()
    for form in accepted:
        assert form in str(raised.value), (form, str(raised.value))


# ---- prompts ---------------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(BAD_PROMPTS))
def test_bad_prompt_is_refused_everywhere(model, case):
    value, error, given = BAD_PROMPTS[case]
    for name, call in prompt_calls(model).items():
        with pytest.raises(error, match=given) as raised:
            call(value)
        for form in ACCEPTED:
            assert form in str(raised.value), (name, form, str(raised.value))


def test_to_str_tokens_refuses_bools_as_ids(model):
    # Bools are not token ids (TransformerLens raises ValueError for them too).
    raises_naming(ValueError, "True", lambda: model.to_str_tokens([True, False]), "a str")


def test_valid_prompts_still_run(model):
    ids = model.token_lists(TEXT)[0]
    other = model.token_lists("A dog")[0]
    logits = model(TEXT)
    for same in (ids, tuple(ids), [ids], torch.tensor(ids), torch.tensor([ids]),
                 torch.tensor(ids, dtype=torch.int32), np.array(ids), [np.array(ids)]):
        assert torch.equal(model(same), logits), type(same)
    batch = model([TEXT, "A dog"])
    assert torch.equal(model([ids, other]), batch)
    assert torch.equal(model([torch.tensor(ids), torch.tensor(other)]), batch)
    _, cache = model.run_with_cache(torch.tensor([ids, ids]), names_filter=[])
    assert cache.tokens.dtype == torch.long
    greedy = model.generate(TEXT, max_new_tokens=2, do_sample=False, return_type="tokens")
    assert torch.equal(model.generate(torch.tensor(ids), max_new_tokens=2, do_sample=False), greedy)
    texts = model.generate([TEXT, "A dog"], max_new_tokens=2, do_sample=False)
    assert texts[0].startswith(TEXT) and texts[1].startswith("A dog")


# ---- generation settings ---------------------------------------------------------------------


RETURN_TYPES = "'input', 'str', 'tokens', 'result'"
BAD_SETTINGS = [
    ("return_type", "bogus", ValueError, "'bogus'", RETURN_TYPES),
    ("return_type", None, ValueError, "None", RETURN_TYPES),
    ("max_new_tokens", 2.5, TypeError, "2.5", "an int >= 1"),
    ("max_new_tokens", True, TypeError, "True", "an int >= 1"),
    ("max_new_tokens", 0, ValueError, "not 0", "an int >= 1"),
    ("max_new_tokens", -3, ValueError, "-3", "an int >= 1"),
    ("temperature", "hot", TypeError, "'hot'", "a number >= 0"),
    ("temperature", -1.0, ValueError, "-1.0", "a number >= 0"),
    ("top_k", 0, ValueError, "not 0", "an int >= 1"),
    ("top_k", 2.5, TypeError, "2.5", "an int >= 1"),
    ("top_p", 0.0, ValueError, "0.0", "(0, 1]"),
    ("top_p", 1.5, ValueError, "1.5", "(0, 1]"),
    ("top_p", "0.9", TypeError, "'0.9'", "(0, 1]"),
]


@pytest.mark.parametrize(
    "name, value, error, given, accepted",
    BAD_SETTINGS,
    ids=[f"{name}={value!r}" for name, value, *_ in BAD_SETTINGS],
)
def test_bad_generate_setting_is_refused(model, name, value, error, given, accepted):
    call = lambda: model.generate(TEXT, **{"max_new_tokens": 2, name: value})  # noqa: E731
    raises_naming(error, given, call, name, accepted)


@pytest.mark.parametrize("value, error", [(2.5, TypeError), (-1, ValueError)])
def test_bad_run_with_cache_max_new_tokens_is_refused(model, value, error):
    raises_naming(error, str(value), lambda: model.run_with_cache(TEXT, max_new_tokens=value),
                  "an int >= 0")


def test_valid_generate_settings_still_run(model):
    sampled = model.generate(TEXT, max_new_tokens=np.int64(2), temperature=0.7, top_k=5,
                             top_p=0.9, seed=0, return_type="result")
    assert len(sampled[0].tokens) == 2


# ---- max_model_len ---------------------------------------------------------------------------


def test_generation_past_max_model_len_warns_with_the_numbers(model):
    max_model_len = model.engine.llm.model_config.max_model_len
    length = max_model_len - 3
    prompt = [7] * length
    with pytest.warns(UserWarning) as caught:
        result = model.generate(prompt, max_new_tokens=8, do_sample=False, stop_at_eos=False,
                                return_type="result")
    message = str(caught[0].message)
    for number in (f"{length} tokens", "max_new_tokens=8", f"max_model_len={max_model_len}",
                   "after 3 new tokens"):
        assert number in message, message
    assert caught[0].filename == __file__  # points at the caller's line
    assert len(result[0].tokens) == 3  # vLLM's cap, now said out loud

    with pytest.warns(UserWarning, match=f"max_model_len={max_model_len}"):
        model.run_with_cache(prompt, names_filter=[], max_new_tokens=8)


def test_generation_within_max_model_len_does_not_warn(model):
    max_model_len = model.engine.llm.model_config.max_model_len
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.generate([7] * (max_model_len - 3), max_new_tokens=3, do_sample=False)
    assert not [w for w in caught if "max_model_len" in str(w.message)]
