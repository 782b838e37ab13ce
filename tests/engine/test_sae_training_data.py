"""Activations for training SAEs with SAELens: ``vlens.store.activation_batches`` (shuffled
batches from the live engine) and the SAELens dataset export of a store
(``vlens.store.saelens``, ``vlens cache --format saelens``)."""

import itertools
import json
from collections import Counter
from pathlib import Path

import datasets
import pytest
import test_cli
import torch
from datasets import Array2D, Features, Sequence, Value
from safetensors.torch import load_file
from test_cli import TEXTS

from vlens import cli
from vlens.names.resolve import UnknownHookName
from vlens.store import activation_batches, saelens
from vlens.store.activations import StoreError, write_activations
from vlens.store.saelens import write_saelens_dataset

model, prompts = test_cli.model, test_cli.prompts  # its fixtures (the session's tiny Llama)

Z = "blocks.1.attn.hook_z"  # [pos, head, d_head] = [pos, 4, 32]: rows of 128
RESID = "blocks.0.hook_resid_post"
BATCH = 8
CLOSE = dict(rtol=1e-4, atol=1e-4)  # batches of other compositions round differently


@pytest.fixture
def engine(hooked):
    return hooked("llama")


def reference_rows(engine, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every real token's row of ``name`` over TEXTS, its prompt's index and its token id."""
    _, cache = engine.run_with_cache(TEXTS, names_filter=[name], return_type=None)
    rows = [cache.unpadded(name, index).flatten(1) for index in range(len(TEXTS))]
    prompt = torch.cat([torch.full((len(r),), index) for index, r in enumerate(rows)])
    tokens = torch.cat([cache.tokens[i, : len(r)] for i, r in enumerate(rows)])
    return torch.cat(rows), prompt, tokens


def matched(batches: list[torch.Tensor], expected: torch.Tensor) -> torch.Tensor:
    """Which reference row each batched row is (the nearest), asserting it is that row."""
    got = torch.cat(batches)
    nearest = torch.cdist(got, expected).argmin(dim=1)
    torch.testing.assert_close(got, expected[nearest], **CLOSE)
    return nearest


def same_rows(expected: torch.Tensor) -> torch.Tensor:
    """For each reference row, the first one equal to it (tokens at the same position after the
    same prefix, such as a leading BOS, have equal rows)."""
    distance = torch.cdist(expected, expected)
    return (distance <= 1e-4 * (1 + expected.norm(dim=1))[None, :]).int().argmax(dim=1)


def test_every_row_once_shuffled_and_mixed(engine):
    expected, prompt_of, _ = reference_rows(engine, Z)
    lazy = (text for text in TEXTS)  # a generator: consumed as the batches are taken
    batches = list(activation_batches(engine, lazy, Z, BATCH, buffer_batches=2, prompts_per_call=2))

    total = len(expected)
    assert [b.shape for b in batches] == [(BATCH, 128)] * (total // BATCH) + (
        [(total % BATCH, 128)] if total % BATCH else []
    )  # the last batch is short
    nearest = matched(batches, expected)
    alias = same_rows(expected)
    assert Counter(alias[nearest].tolist()) == Counter(alias.tolist())  # each row exactly once
    assert nearest.tolist() != sorted(nearest.tolist())  # shuffled
    prompts_per_batch = [len(set(prompt_of[n].tolist())) for n in nearest.split(BATCH)]
    print(prompts_per_batch)
    assert max(prompts_per_batch) > 2  # prompts mixed in a batch
    assert sum(count > 1 for count in prompts_per_batch) > len(batches) // 2

    def order(**options) -> list[int]:
        found = activation_batches(engine, TEXTS, Z, BATCH, buffer_batches=2, prompts_per_call=2,
                                   **options)
        return alias[matched(list(found), expected)].tolist()

    assert order(seed=0) == alias[nearest].tolist()
    assert order(seed=1) != alias[nearest].tolist()

    kept = list(activation_batches(engine, TEXTS, Z, BATCH, buffer_batches=2, drop_last=True))
    assert len(kept) == total // BATCH and all(b.shape == (BATCH, 128) for b in kept)


def test_bos_rows_left_out_and_endless_prompts(engine):
    expected, _, tokens = reference_rows(engine, RESID)
    bos = engine.tokenizer.bos_token_id
    assert (tokens == bos).sum() == len(TEXTS)  # one BOS per prompt, prepended
    batches = list(activation_batches(engine, TEXTS, RESID, BATCH, exclude_bos=True))
    nearest = matched(batches, expected)
    assert len(nearest) == len(expected) - len(TEXTS)
    assert not (tokens[nearest] == bos).any()

    endless = itertools.cycle(TEXTS)  # never ends: only what the batches need is run
    first = list(itertools.islice(activation_batches(engine, endless, RESID, BATCH), 5))
    assert [b.shape for b in first] == [(BATCH, engine.cfg.d_model)] * 5


def test_bad_requests_are_refused_before_any_prompt_runs(engine, monkeypatch):
    def untouched():
        raise AssertionError("no prompt should be read")
        yield

    def no_run(*args, **kwargs):
        raise AssertionError("no engine work for a refused request")

    monkeypatch.setattr(engine, "run_with_cache", no_run)
    with pytest.raises(UnknownHookName, match="blocks.1.hook_resid_post"):
        activation_batches(engine, untouched(), "blocks.1.hook_resid_postt", BATCH)
    with pytest.raises(ValueError, match="not one row per token"):
        activation_batches(engine, untouched(), "blocks.0.attn.hook_pattern", BATCH)
    with pytest.raises(ValueError, match="one hook name, not a pattern"):
        activation_batches(engine, untouched(), "blocks.*.hook_resid_post", BATCH)
    with pytest.raises(ValueError, match="batch_size must be positive"):
        activation_batches(engine, untouched(), RESID, 0)
    with pytest.raises(ValueError, match="buffer_batches must be at least 2"):
        activation_batches(engine, untouched(), RESID, BATCH, buffer_batches=1)


# ---- the SAELens dataset of a store --------------------------------------------------------------


def features(context_size: int, dtype: str = "float32") -> Features:
    return Features({
        RESID: Array2D(shape=(context_size, 128), dtype=dtype),
        Z: Array2D(shape=(context_size, 128), dtype=dtype),
        "token_ids": Sequence(Value("int32"), length=context_size),
    })


def store_contexts(store: Path, context_size: int) -> list[dict[str, torch.Tensor]]:
    """Each stored prompt's first ``context_size`` rows (flattened per token) and token ids."""
    manifest = json.loads((store / "manifest.json").read_text())
    shards = [load_file(store / shard["file"]) for shard in manifest["shards"]]
    contexts = []
    for p in manifest["prompts"]:
        rows = slice(p["start"], p["start"] + context_size)
        context = {name: shards[p["shard"]][name][rows].flatten(1).float() for name in (RESID, Z)}
        context["token_ids"] = torch.tensor(p["tokens"][:context_size], dtype=torch.int32)
        contexts.append(context)
    return contexts


def assert_dataset_is_store(folder: Path, store: Path, context_size: int, dtype: str) -> None:
    dataset = datasets.load_from_disk(str(folder))
    assert dataset.column_names == [RESID, Z, "token_ids"]
    assert dataset.features == features(context_size, dtype)
    expected = store_contexts(store, context_size)
    assert dataset.num_rows == len(expected)
    dataset.set_format(type="torch")
    for index, context in enumerate(expected):
        row = dataset[index]
        for name in (RESID, Z):
            assert torch.equal(row[name], context[name])
        assert torch.equal(row["token_ids"].int(), context["token_ids"])


def test_export_has_saelens_layout_and_the_store_rows(engine, tmp_path, monkeypatch):
    generator = torch.Generator().manual_seed(0)
    same_length = torch.randint(1, 512, (5, 9), generator=generator).tolist()
    store = tmp_path / "store"
    write_activations(engine, same_length, [RESID, Z], store, shard_tokens=20, progress=False)
    assert len(json.loads((store / "manifest.json").read_text())["shards"]) == 3

    written = write_saelens_dataset(store)
    assert (written.folder, written.context_size, written.contexts) == (store / "saelens", 9, 5)
    assert written.d_in == {RESID: 128, Z: 128} and written.written
    assert_dataset_is_store(store / "saelens", store, 9, "float32")
    assert sorted(p.name for p in tmp_path.joinpath("store").iterdir() if "saelens" in p.name) == [
        "saelens"  # no temporary folder or cache left
    ]

    files = {p.name: p.stat().st_mtime_ns for p in (store / "saelens").iterdir()}

    def no_writing(*args, **kwargs):
        raise AssertionError("a complete dataset of the same store is not written again")

    monkeypatch.setattr(datasets.Dataset, "from_generator", no_writing)
    assert not write_saelens_dataset(store).written
    assert {p.name: p.stat().st_mtime_ns for p in (store / "saelens").iterdir()} == files


def test_prompts_of_unequal_lengths_need_a_context_size(engine, tmp_path):
    store = tmp_path / "store"
    write_activations(engine, TEXTS, [RESID, Z], store, dtype="bfloat16", progress=False)
    lengths = [len(tokens) for tokens in engine.token_lists(TEXTS)]
    shortest = min(lengths)
    with pytest.raises(StoreError, match=rf"prompt 1 has {lengths[1]} tokens and prompt 0 has "
                       rf"{lengths[0]}: .*--context-size N, at most {shortest}"):
        write_saelens_dataset(store)
    with pytest.raises(StoreError, match=rf"fewer than the context size {shortest + 1}"):
        write_saelens_dataset(store, context_size=shortest + 1)
    assert not (store / "saelens").exists()

    cut = write_saelens_dataset(store, context_size=shortest)
    assert cut.rows_left_out == sum(lengths) - shortest * len(TEXTS)
    # Arrow has no bfloat16: the store's bfloat16 rows are written as float32, exactly.
    assert_dataset_is_store(store / "saelens", store, shortest, "float32")
    assert write_saelens_dataset(store, context_size=shortest - 1).written  # new settings
    assert_dataset_is_store(store / "saelens", store, shortest - 1, "float32")


def test_a_folder_that_is_not_an_export_is_not_replaced(engine, tmp_path):
    store = tmp_path / "store"
    write_activations(engine, [[5, 6, 7]] * 2, [RESID], store, progress=False)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(StoreError, match="is not a SAELens dataset written from a vlens store"):
        write_saelens_dataset(store, tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    with pytest.raises(StoreError, match="does not hold blocks.1.attn.hook_z"):
        write_saelens_dataset(store, names=[Z])


def test_cache_command_writes_the_saelens_dataset(model, prompts, tmp_path, capsys, monkeypatch):
    out = tmp_path / "acts"
    command = ["cache", "llama", "--prompts", str(prompts), "--names", RESID, Z, "--out",
               str(out), "--format", "saelens", "--context-size", "2"]
    assert cli.main(command) == 0
    assert "SAELens dataset written: " in capsys.readouterr().out
    assert_dataset_is_store(out / "saelens", out, 2, "float32")

    monkeypatch.setattr(saelens, "_contexts", None)  # a rerun writes nothing
    assert cli.main(command) == 0
    assert "already written for this store, kept" in capsys.readouterr().out
