"""The ``vlens`` command, run in-process on tiny models: ``cache`` (the activation store, its
manifest and resuming), ``names``, ``lens`` (table and plot) and ``parity``."""

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from vlens import HookedVLLM, cli
from vlens.mappings import checkpoint_specs
from vlens.names.resolve import UnknownHookName
from vlens.store import activations as activation_store
from vlens.store.activations import StoreError, write_activations
from vlens.store.inputs import read_prompts, stored_names
from vlens.testing.tiny import tiny_model

TEXTS = [
    "The river ran past the old mill",
    "Hello world",
    "What is the capital of France? Paris is the capital of France.",
    "A computer is a machine that follows instructions",
    "cheese",
    "Scientists study the world by asking questions and testing their answers.",
    "In winter the roads were covered with snow",
]
PATTERNS = ["hook_embed", "blocks.*.hook_resid_post", "blocks.1.attn.hook_z"]
NAMES = ["hook_embed", "blocks.0.hook_resid_post", "blocks.1.attn.hook_z",  # forward order
         "blocks.1.hook_resid_post", "blocks.2.hook_resid_post"]
SHARD_TOKENS = 24  # several shards of several prompts each
# Values computed in differently composed batches may round differently on the CPU backend
# (see test_batching); 1e-5 is far below any misplaced row.
CLOSE = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture
def model(hooked, monkeypatch) -> HookedVLLM:
    """The session's tiny Llama engine, handed to the CLI instead of a new one: engines are the
    slow part of the suite."""
    engine = hooked("llama")

    def from_pretrained(cls, path, **engine_args):
        assert Path(path) == tiny_model("llama")
        return engine

    monkeypatch.setattr(HookedVLLM, "from_pretrained", classmethod(from_pretrained))
    return engine


@pytest.fixture
def no_engine(monkeypatch) -> None:
    """For requests that must fail before an engine loads."""

    def from_pretrained(cls, path, **engine_args):
        raise AssertionError("the engine should not load for a request that cannot run")

    monkeypatch.setattr(HookedVLLM, "from_pretrained", classmethod(from_pretrained))


@pytest.fixture
def prompts(tmp_path) -> Path:
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(TEXTS[:3] + [""] + TEXTS[3:]) + "\n")  # blank lines are skipped
    return path


def cache(prompts: Path, out: Path, *options: str) -> int:
    return cli.main(["cache", "llama", "--prompts", str(prompts), "--names", *PATTERNS,
                     "--out", str(out), "--batch-size", "3", "--shard-tokens", str(SHARD_TOKENS),
                     *options])


def stored(out: Path) -> tuple[dict, list[dict[str, torch.Tensor]]]:
    """The manifest, and each prompt's rows of every name as the manifest locates them."""
    manifest = json.loads((out / "manifest.json").read_text())
    shards = [load_file(out / shard["file"]) for shard in manifest["shards"]]
    rows = [
        {name: shards[p["shard"]][name][p["start"] : p["stop"]] for name in manifest["names"]}
        for p in manifest["prompts"]
    ]
    return manifest, rows


def test_cache_rows_are_run_with_cache_values(model, prompts, tmp_path):
    out = tmp_path / "store"
    assert cache(prompts, out) == 0
    manifest, rows = stored(out)

    assert list(manifest["names"]) == NAMES
    assert manifest["names"]["blocks.1.attn.hook_z"] == {"shape": [4, 32], "dtype": "float32"}
    assert manifest["names"]["hook_embed"] == {"shape": [128], "dtype": "float32"}
    assert manifest["dtype"] == "float32"
    assert Path(manifest["model"]) == tiny_model("llama").resolve()
    assert set(manifest["versions"]) == {"vlens", "vllm", "torch"}
    assert sorted(path.name for path in out.iterdir()) == ["manifest.json"] + [
        shard["file"] for shard in manifest["shards"]
    ]

    _, expected = model.run_with_cache(TEXTS, names_filter=NAMES, return_type=None)
    assert [p["tokens"] for p in manifest["prompts"]] == model.token_lists(TEXTS)
    for index, prompt_rows in enumerate(rows):
        for name in NAMES:
            torch.testing.assert_close(prompt_rows[name], expected.unpadded(name, index), **CLOSE)

    # Shards hold whole prompts, back to back, at most SHARD_TOKENS rows each unless one prompt
    # alone is longer (one of TEXTS is).
    assert len(manifest["shards"]) > 1
    for index, shard in enumerate(manifest["shards"]):
        ranges = [(p["start"], p["stop"]) for p in manifest["prompts"] if p["shard"] == index]
        starts, stops = zip(*ranges)
        assert starts[0] == 0 and list(starts[1:]) == list(stops[:-1])
        assert stops[-1] == shard["rows"]
        assert shard["rows"] <= SHARD_TOKENS or len(ranges) == 1
    assert max(map(len, model.token_lists(TEXTS))) > SHARD_TOKENS


def test_jsonl_prompts_and_generated_positions(model, tmp_path):
    """A JSONL file mixes texts and token ids; max_new_tokens adds rows past the prompt."""
    path = tmp_path / "prompts.jsonl"
    ids = model.token_lists(TEXTS[2])[0]
    path.write_text(json.dumps({"text": TEXTS[0]}) + "\n" + json.dumps({"tokens": ids}) + "\n")
    out = tmp_path / "store"
    names = ["blocks.2.hook_resid_post"]
    write_activations(model, read_prompts(path), names, out,
                      max_new_tokens=3, progress=False)
    manifest, rows = stored(out)

    _, expected = model.run_with_cache([model.token_lists(TEXTS[0])[0], ids], names_filter=names,
                                       return_type=None, max_new_tokens=3)
    for index, prompt in enumerate(manifest["prompts"]):
        length = int(expected.lengths[index])
        assert prompt["stop"] - prompt["start"] == length == prompt["prompt_length"] + 2
        assert prompt["tokens"] == expected.tokens[index, :length].tolist()
        torch.testing.assert_close(
            rows[index][names[0]], expected.unpadded(names[0], index), **CLOSE
        )
    assert manifest["prompts"][1]["tokens"][: len(ids)] == ids


def test_integer_names_keep_their_dtype(hooked, tmp_path):
    """Expert indices are stored exactly, beside router logits in the store's dtype."""
    model = hooked("deepseek_v3")
    names = ["blocks.1.mlp.hook_expert_indices", "blocks.1.mlp.hook_router_logits"]
    write_activations(model, TEXTS[:2], names, tmp_path, dtype="bfloat16", progress=False)
    manifest, rows = stored(tmp_path)
    assert manifest["names"] == {
        names[0]: {"shape": [2], "dtype": "int64"},
        names[1]: {"shape": [8], "dtype": "bfloat16"},
    }
    _, expected = model.run_with_cache(TEXTS[:2], names_filter=names, return_type=None)
    for index in range(2):
        assert torch.equal(rows[index][names[0]], expected.unpadded(names[0], index))
        torch.testing.assert_close(
            rows[index][names[1]], expected.unpadded(names[1], index).bfloat16(), **CLOSE
        )


def test_interrupted_run_resumes_to_the_same_store(model, prompts, tmp_path, monkeypatch):
    whole = tmp_path / "whole"
    cache(prompts, whole)

    # Crash while writing the second shard: its temporary file is left half written.
    out = tmp_path / "resumed"
    real_save_file, saved = activation_store.save_file, []

    def crash_on_second_shard(tensors, path):
        if saved:
            Path(path).write_bytes(b"half a shard")
            raise KeyboardInterrupt
        saved.append(path)
        real_save_file(tensors, path)

    monkeypatch.setattr(activation_store, "save_file", crash_on_second_shard)
    with pytest.raises(KeyboardInterrupt):
        cache(prompts, out)
    monkeypatch.setattr(activation_store, "save_file", real_save_file)

    interrupted, _ = stored(out)
    assert [shard["file"] for shard in interrupted["shards"]] == ["shard-00000.safetensors"]
    assert (out / "shard-00001.safetensors.tmp").read_bytes() == b"half a shard"
    # A whole shard renamed into place just before the crash, but never recorded, is dropped too.
    (out / "shard-00001.safetensors").write_bytes((out / "shard-00000.safetensors").read_bytes())

    run_with_cache, ran = model.run_with_cache, []

    def counting(batch, **options):
        ran.extend(batch)
        return run_with_cache(batch, **options)

    monkeypatch.setattr(model, "run_with_cache", counting)
    assert cache(prompts, out) == 0
    assert len(ran) == len(TEXTS) - len(interrupted["prompts"])  # stored prompts are not rerun
    resumed_manifest, _ = stored(out)
    whole_manifest, _ = stored(whole)
    assert resumed_manifest == whole_manifest
    assert sorted(path.name for path in out.iterdir()) == sorted(p.name for p in whole.iterdir())
    for shard in whole_manifest["shards"]:
        expected, got = load_file(whole / shard["file"]), load_file(out / shard["file"])
        for name in NAMES:
            torch.testing.assert_close(got[name], expected[name], **CLOSE)


def test_resume_refuses_other_settings_or_prompts(model, prompts, tmp_path):
    out = tmp_path / "store"
    cache(prompts, out, "--max-new-tokens", "0")
    with pytest.raises(SystemExit, match=r"dtype float32 \(this run: bfloat16\)"):
        cache(prompts, out, "--dtype", "bfloat16")
    with pytest.raises(SystemExit, match="names"):
        cli.main(["cache", "llama", "--prompts", str(prompts), "--names", "hook_embed",
                  "--out", str(out)])
    more = tmp_path / "more.txt"
    more.write_text("\n".join(TEXTS[::-1] * 2))
    with pytest.raises(StoreError, match="same prompts"):
        write_activations(model, read_prompts(more), PATTERNS, out,
                          shard_tokens=SHARD_TOKENS, progress=False)


def test_name_patterns_fail_before_the_engine_loads(no_engine, prompts, tmp_path):
    out = str(tmp_path / "store")
    base = ["cache", "llama", "--prompts", str(prompts), "--out", out, "--names"]
    suggestion = r"no hook name of this model matches .*Did you mean: blocks\.\*\.hook_resid_post"
    with pytest.raises(SystemExit, match=suggestion):
        cli.main([*base, "blocks.*.hook_resid_pots"])
    with pytest.raises(SystemExit, match="Did you mean: blocks.0.hook_resid_post"):
        cli.main([*base, "blocks.0.hook_resid_psot"])
    with pytest.raises(SystemExit, match="only token-major names"):
        cli.main([*base, "blocks.*.attn.hook_pattern"])


def test_stored_names():
    specs = checkpoint_specs(tiny_model("llama"))
    assert stored_names(PATTERNS, specs) == NAMES
    assert stored_names(["blocks.1.hook_out", "blocks.1.*.hook_z"], specs) == [
        "blocks.1.attn.hook_z", "blocks.1.hook_resid_post"
    ]
    with pytest.raises(UnknownHookName):
        stored_names(["hook_pos_embed"], specs)
    with pytest.raises(StoreError, match="head query_pos key_pos"):
        stored_names(["blocks.0.attn.hook_attn_scores"], specs)


def test_names_and_lens_table(model, capsys):
    cli.main(["names", "llama"])
    listed = capsys.readouterr().out.splitlines()
    assert "blocks.2.hook_resid_post [batch pos d_model]" in [" ".join(line.split()) for line in listed]
    cli.main(["lens", "llama", "The capital of France is"])
    table = capsys.readouterr().out
    assert "layer |" in table
    assert [line.split("|")[0].strip() for line in table.splitlines() if "|" in line][1:] == [
        "0", "1", "2"
    ]


def test_lens_plot_writes_a_png(model, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    plot = tmp_path / "lens.png"
    cli.main(["lens", "llama", "The capital of France is", "--plot", str(plot)])
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_lens_plot_without_matplotlib_says_how_to_install(no_engine, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # find_spec now reports it missing
    with pytest.raises(SystemExit, match="pip install matplotlib"):
        cli.main(["lens", "llama", "--plot", str(tmp_path / "lens.png")])


def test_parity_passes_its_arguments_through(monkeypatch):
    import vlens.parity.__main__ as parity

    calls = []
    monkeypatch.setattr(parity, "main", lambda argv: calls.append(argv) or 1)
    assert cli.main(["parity", "qwen3", "llama", "--out", "report.md"]) == 1
    assert calls == [["qwen3", "llama", "--out", "report.md"]]
