"""vlens's token methods give what TransformerLens 4.3's give on the same checkpoint.

No engine: a :class:`~vlens.hooked.tokens.TokenMethods` over the checkpoint's tokenizer and
``ModelConfig.from_hf`` is compared with ``TransformerBridge.boot_transformers(path)`` (the
tiny test checkpoints, and the real SmolLM2 as a slow test), call by call: results, dtypes,
devices, and the exception types where TransformerLens raises.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoTokenizer

from vlens.hooked.config import ModelConfig, default_prepend_bos_for
from vlens.hooked.tokens import NotOneTokenError, TokenMethods, prepare_tokenizer
from vlens.mappings import all_mappings, mapping_for
from vlens.testing.tiny import ARCHS, tiny_model

TEXTS = [
    "Hello world",
    "The river ran past the old mill, and the river turned the wheel.",
    " leading space",
    "a",
    "",
    "numbers 12345 and symbols !?#",
    "ünïcödé text — dashes",
    "<|bos|>already has a bos",
    "<|im_start|>user\nHi there<|im_end|>",
    "trailing newline\n",
]
BATCHES = [
    ["Hello world", "a"],
    ["a", "The river ran past the old mill", " leading space", ""],
    ["same length", "same length"],
]
PREPEND = [None, True, False]
SIDES = [None, "left", "right"]


class Tokens(TokenMethods):
    """Just the token methods: a tokenizer and a cfg, as ``HookedVLLM`` holds them."""

    def __init__(self, path: Path, prepared: bool = True, **settings: Any) -> None:
        config = AutoConfig.from_pretrained(path)
        tokenizer = AutoTokenizer.from_pretrained(path)
        side = settings.get("default_padding_side")
        self.tokenizer = prepare_tokenizer(tokenizer, side) if prepared else tokenizer
        mapping = mapping_for(config)
        names = list(mapping.expanded(config))
        self.cfg = ModelConfig.from_hf(config, mapping, names, tokenizer=self.tokenizer, **settings)


def boot(path: Path) -> Any:
    from transformer_lens.model_bridge.bridge import TransformerBridge

    bridge = TransformerBridge.boot_transformers(str(path), device="cpu", dtype=torch.float32)
    bridge.enable_compatibility_mode(no_processing=True)
    return bridge


def checkpoint(name: str) -> Path:
    if name == "smollm2":
        from vlens.testing.embedded import smollm2_path

        return smollm2_path()
    return tiny_model(name)


@pytest.fixture(
    scope="module",
    params=["llama", "qwen3", "gpt2", pytest.param("smollm2", marks=pytest.mark.slow)],
)
def pair(request: pytest.FixtureRequest) -> tuple[Tokens, Any]:
    path = checkpoint(request.param)
    return Tokens(path), boot(path)


def same(ours: Callable[[], Any], theirs: Callable[[], Any]) -> None:
    """Both give equal results, or both raise, ours an instance of TransformerLens's type."""
    try:
        expected = theirs()
    except Exception as error:
        with pytest.raises(type(error)):
            ours()
        return
    got = ours()
    if isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor)
        assert (got.dtype, got.shape, str(got.device)) == (
            expected.dtype, expected.shape, str(expected.device)
        )
        assert torch.equal(got, expected), (got, expected)
    else:
        assert type(got) is type(expected)
        assert got == expected


# ---- configuration -----------------------------------------------------------------------------


def test_cfg_matches_transformer_lens(pair):
    ours, bridge = pair
    assert ours.cfg.default_prepend_bos == bridge.cfg.default_prepend_bos
    assert ours.cfg.tokenizer_prepends_bos == bridge.cfg.tokenizer_prepends_bos
    assert ours.cfg.tokenizer_appends_eos == bridge.cfg.tokenizer_appends_eos
    assert ours.cfg.n_ctx == bridge.cfg.n_ctx
    assert ours.cfg.device == str(bridge.cfg.device) == "cpu"
    assert ours.cfg.default_padding_side == bridge.tokenizer.padding_side
    for attribute in ("bos_token_id", "eos_token_id", "pad_token_id", "padding_side"):
        assert getattr(ours.tokenizer, attribute) == getattr(bridge.tokenizer, attribute)
    assert ours.tokenizer("a")["input_ids"] == bridge.tokenizer("a")["input_ids"]


def test_default_prepend_bos_of_every_mapped_architecture_is_transformer_lens_s():
    tiny = {AutoConfig.from_pretrained(tiny_model(arch)).architectures[0]: arch for arch in ARCHS}
    mapped = {arch for mapping in all_mappings() for arch in mapping.architectures}
    assert mapped <= set(tiny), f"no tiny checkpoint to check {mapped - set(tiny)} against"
    from transformer_lens.factories.architecture_adapter_factory import SUPPORTED_ARCHITECTURES

    for architecture in sorted(mapped):
        if architecture not in SUPPORTED_ARCHITECTURES:  # no adapter: TransformerLens's default
            assert default_prepend_bos_for(architecture), architecture
            continue
        bridge = boot(tiny_model(tiny[architecture]))
        assert default_prepend_bos_for(architecture) == bridge.cfg.default_prepend_bos, architecture


# ---- strings -> tokens ---------------------------------------------------------------------------


@pytest.mark.parametrize("prepend_bos", PREPEND)
def test_to_tokens_of_one_string(pair, prepend_bos):
    ours, bridge = pair
    for text in TEXTS:
        same(lambda: ours.to_tokens(text, prepend_bos=prepend_bos),
             lambda: bridge.to_tokens(text, prepend_bos=prepend_bos))


@pytest.mark.parametrize("prepend_bos", PREPEND)
@pytest.mark.parametrize("padding_side", SIDES)
def test_to_tokens_of_a_batch(pair, prepend_bos, padding_side):
    ours, bridge = pair
    for batch in BATCHES:
        same(lambda: ours.to_tokens(batch, prepend_bos, padding_side),
             lambda: bridge.to_tokens(batch, prepend_bos, padding_side))


@pytest.mark.parametrize("prepend_bos", PREPEND)
@pytest.mark.parametrize("truncate", [True, False])
def test_truncation_to_n_ctx(pair, prepend_bos, truncate):
    ours, bridge = pair
    batch = ["the river " * (ours.cfg.n_ctx // 2 + 8), "short"]
    same(lambda: ours.to_tokens(batch, prepend_bos, truncate=truncate),
         lambda: bridge.to_tokens(batch, prepend_bos, truncate=truncate))


def test_to_tokens_device(pair):
    ours, bridge = pair
    same(lambda: ours.to_tokens("Hello", move_to_device=False),
         lambda: bridge.to_tokens("Hello", move_to_device=False))
    assert ours.to_tokens("Hello").device == torch.device(ours.cfg.device)


@pytest.mark.parametrize("prepend_bos", PREPEND)
@pytest.mark.parametrize("padding_side", SIDES)
def test_token_lists_are_the_unpadded_rows_of_to_tokens(pair, prepend_bos, padding_side):
    ours, bridge = pair
    bos = ours.cfg.default_prepend_bos if prepend_bos is None else prepend_bos
    batch = [text for text in BATCHES[1] if text or bos]  # "" alone is no prompt
    rows = ours.token_lists(batch, prepend_bos, padding_side)
    tokens = bridge.to_tokens(batch, prepend_bos, padding_side)
    for row, padded in zip(rows, tokens.tolist()):
        real = padded[len(padded) - len(row):] if padding_side == "left" else padded[: len(row)]
        assert row == real
    alone = bridge.to_tokens(batch[0], prepend_bos)
    assert ours.token_lists(batch[0], prepend_bos) == alone.tolist()


def test_token_ids_pass_through_unchanged(pair):
    ours, _ = pair
    ids = [5, 9, 3]
    assert ours.token_lists(ids) == [ids]
    assert ours.token_lists([ids, [7]]) == [ids, [7]]
    assert ours.token_lists(torch.tensor(ids)) == [ids]
    assert ours.token_lists(torch.tensor([ids, ids])) == [ids, ids]
    assert ours.token_lists(np.array(ids)) == [ids]
    pad = ours.tokenizer.pad_token_id
    assert ours.to_tokens([ids, [7]], padding_side="left").tolist() == [ids, [pad, pad, 7]]
    assert torch.equal(ours.to_tokens(torch.tensor(ids)), torch.tensor([ids]))


def test_token_lists_validation(pair):
    ours, _ = pair
    with pytest.raises(ValueError, match="empty"):
        ours.token_lists([])
    with pytest.raises(ValueError, match="no tokens"):
        ours.token_lists("", prepend_bos=False)
    with pytest.raises(ValueError, match="no tokens"):
        ours.token_lists([[1, 2], []])
    with pytest.raises(ValueError, match="outside"):
        ours.token_lists([ours.cfg.d_vocab])
    with pytest.raises(ValueError, match="outside"):
        ours.token_lists(torch.tensor([[1, -1]]))
    with pytest.raises(ValueError, match="padding_side"):
        ours.token_lists("a", padding_side="middle")
    with pytest.raises(TypeError, match="prepend_bos"):
        ours.token_lists("a", prepend_bos="tokenizer")


# ---- tokens -> strings ---------------------------------------------------------------------------


@pytest.mark.parametrize("prepend_bos", PREPEND)
def test_to_str_tokens_of_strings(pair, prepend_bos):
    ours, bridge = pair
    for text in TEXTS:
        same(lambda: ours.to_str_tokens(text, prepend_bos),
             lambda: bridge.to_str_tokens(text, prepend_bos))
    for batch in BATCHES:
        for side in SIDES:
            same(lambda: ours.to_str_tokens(batch, prepend_bos, side),
                 lambda: bridge.to_str_tokens(batch, prepend_bos, side))


def test_to_str_tokens_of_token_ids(pair):
    ours, bridge = pair
    tokens = bridge.to_tokens(TEXTS[1])
    for value in (tokens, tokens[0], tokens[0].numpy(), tokens.numpy(), tokens[0, 3],
                  [tokens[0], tokens[0, :4]], torch.tensor([[1, 2], [3, 4]])):
        same(lambda: ours.to_str_tokens(value), lambda: bridge.to_str_tokens(value))
    # TransformerLens raises for lists of ids; vlens reads them as sequences, like a tensor.
    ids = tokens[0].tolist()
    assert ours.to_str_tokens(ids) == bridge.to_str_tokens(tokens[0])
    assert ours.to_str_tokens([ids, ids[:2]]) == [bridge.to_str_tokens(tokens[0])] + [
        bridge.to_str_tokens(tokens[0, :2])
    ]


def test_to_string(pair):
    ours, bridge = pair
    tokens = bridge.to_tokens(BATCHES[1])
    for value in (tokens, tokens[1], tokens[1].tolist(), tokens.tolist(), tokens.numpy(),
                  tokens[0, 2], 7, tokens[None]):
        same(lambda: ours.to_string(value), lambda: bridge.to_string(value))


def test_to_single_str_token(pair):
    ours, bridge = pair
    for token in [*range(0, 40), *range(ours.cfg.d_vocab - 20, ours.cfg.d_vocab)]:
        same(lambda: ours.to_single_str_token(token), lambda: bridge.to_single_str_token(token))
    for value in (np.int64(5), torch.tensor(5), 5.0):
        same(lambda: ours.to_single_str_token(value), lambda: bridge.to_single_str_token(value))


# ---- single tokens and positions -----------------------------------------------------------------


def test_to_single_token(pair):
    ours, bridge = pair
    pieces = [piece for text in TEXTS for piece in bridge.to_str_tokens(text, prepend_bos=False)]
    for string in [*pieces, *TEXTS, bridge.tokenizer.bos_token, bridge.tokenizer.eos_token]:
        same(lambda: ours.to_single_token(string), lambda: bridge.to_single_token(string))
    with pytest.raises(NotOneTokenError, match="not one") as raised:
        ours.to_single_token("Hello world")
    assert isinstance(raised.value, ValueError) and isinstance(raised.value, AssertionError)


@pytest.mark.parametrize("prepend_bos", PREPEND)
@pytest.mark.parametrize("mode", ["first", "last"])
def test_get_token_position(pair, prepend_bos, mode):
    ours, bridge = pair
    text = "the river and the river and the mill"
    tokens = bridge.to_tokens(text, prepend_bos=prepend_bos)
    singles = [*tokens[0].tolist(), *bridge.to_str_tokens(text, prepend_bos=prepend_bos),
               ours.cfg.d_vocab - 1]
    for single in singles:
        for where in (text, tokens, tokens[0]):
            same(lambda: ours.get_token_position(single, where, mode, prepend_bos),
                 lambda: bridge.get_token_position(single, where, mode, prepend_bos))
    same(lambda: ours.get_token_position(tokens[0, -1], tokens, mode),
         lambda: bridge.get_token_position(tokens[0, -1], tokens, mode))


def test_get_token_position_errors(pair):
    ours, bridge = pair
    tokens = bridge.to_tokens(["the river", "the mill"])
    present = int(tokens[0, -1])
    cases = [
        (present, tokens, "first"),  # a batch of two rows
        (ours.cfg.d_vocab - 1, tokens[0], "first"),  # absent
        (present, tokens[0], "middle"),  # unknown mode
        (ours.cfg.d_vocab - 1, tokens[0], "middle"),  # absent first
        ("the river", tokens[0], "first"),  # not a single token
    ]
    for single, where, mode in cases:
        same(lambda: ours.get_token_position(single, where, mode),
             lambda: bridge.get_token_position(single, where, mode))
    assert ours.get_token_position(present, tokens[0].tolist()) == bridge.get_token_position(
        present, tokens[0]
    )


# ---- settings ------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("default_prepend_bos", [True, False])
@pytest.mark.parametrize("default_padding_side", ["left", "right"])
def test_load_time_defaults_match_transformer_lens_s(
    arch, default_prepend_bos, default_padding_side
):
    path = tiny_model(arch)
    ours = Tokens(path, default_prepend_bos=default_prepend_bos,
                  default_padding_side=default_padding_side)
    bridge = boot(path)
    bridge.cfg.default_prepend_bos = default_prepend_bos
    bridge.tokenizer.padding_side = default_padding_side
    assert ours.cfg.default_padding_side == default_padding_side
    for batch in BATCHES:
        same(lambda: ours.to_tokens(batch), lambda: bridge.to_tokens(batch))
        same(lambda: ours.to_str_tokens(batch), lambda: bridge.to_str_tokens(batch))


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt2"])
def test_checkpoint_tokenizer_as_loaded_gives_the_same_ids(arch):
    """Byte-level BPE: the unprepared tokenizer (no BOS of its own, no pad token) gives
    TransformerLens's ids too, BOS written as text in front of the string."""
    path = tiny_model(arch)
    ours, bridge = Tokens(path, prepared=False), boot(path)
    assert not ours.cfg.tokenizer_prepends_bos and ours.tokenizer.pad_token_id is None
    for prepend_bos in PREPEND:
        for text in TEXTS:
            same(lambda: ours.to_tokens(text, prepend_bos),
                 lambda: bridge.to_tokens(text, prepend_bos))
        for batch in BATCHES:
            for side in SIDES:
                same(lambda: ours.to_tokens(batch, prepend_bos, side),
                     lambda: bridge.to_tokens(batch, prepend_bos, side))
    same(lambda: ours.to_single_token(" river"), lambda: bridge.to_single_token(" river"))


def test_prepare_tokenizer_leaves_the_given_tokenizer_alone():
    tokenizer = AutoTokenizer.from_pretrained(tiny_model("llama"))
    before = (tokenizer("a")["input_ids"], tokenizer.pad_token, tokenizer.padding_side)
    prepared = prepare_tokenizer(tokenizer, "left")
    assert (tokenizer("a")["input_ids"], tokenizer.pad_token, tokenizer.padding_side) == before
    assert prepared("a")["input_ids"] == [prepared.bos_token_id, *before[0]]
    assert prepared.padding_side == "left" and prepared.pad_token == prepared.eos_token
    again = prepare_tokenizer(prepared)  # already TransformerLens's: a copy, left as it is
    assert again is not prepared and again("a")["input_ids"] == prepared("a")["input_ids"]
    assert again.padding_side == "left"
    with pytest.raises(ValueError, match="padding_side"):
        prepare_tokenizer(tokenizer, "middle")  # type: ignore[arg-type]
