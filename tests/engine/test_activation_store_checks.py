"""``vlens cache`` checks its store: each shard's recorded size and sha256 on resume (a resume
rewrites a shard that fails) and with ``--verify``; a broken manifest or an unusable ``--out``
is a one-line error that names the fix."""

import json
import os
import shutil
from pathlib import Path

import pytest
import test_cli
import torch
from safetensors.torch import load_file, save_file
from test_cli import CLOSE, NAMES, cache, stored

from vlens import cli
from vlens.store.manifest import FORMAT, checksums, manifest_problem, shard_problem

model, no_engine, prompts = test_cli.model, test_cli.no_engine, test_cli.prompts  # its fixtures


def verify(out: Path) -> int:
    return cli.main(["cache", "--verify", str(out)])


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def counting_runs(model, monkeypatch) -> list[list[int]]:
    """The prompts (token ids) that the engine runs from now on."""
    run_with_cache, ran = model.run_with_cache, []

    def counting(batch, **options):
        ran.extend(batch)
        return run_with_cache(batch, **options)

    monkeypatch.setattr(model, "run_with_cache", counting)
    return ran


def shard_tokens(manifest: dict, index: int) -> list[list[int]]:
    return [p["tokens"][: p["prompt_length"]] for p in manifest["prompts"] if p["shard"] == index]


def assert_same_store(got: Path, expected: Path) -> None:
    """The same prompts, shards and rows, and every shard matches its recorded size and sha256
    (a sha256 may differ from ``expected``'s: a rewritten shard's prompts run again in other
    batches, whose values may round differently, see test_batching)."""
    got_manifest, expected_manifest = stored(got)[0], stored(expected)[0]
    assert got_manifest["prompts"] == expected_manifest["prompts"]

    def layout(manifest: dict) -> list[tuple]:
        return [(shard["file"], shard["rows"], shard["bytes"]) for shard in manifest["shards"]]

    assert layout(got_manifest) == layout(expected_manifest)
    for shard in got_manifest["shards"]:
        assert checksums(got / shard["file"]) == {k: shard[k] for k in ("bytes", "sha256")}
        rows, expected_rows = load_file(got / shard["file"]), load_file(expected / shard["file"])
        for name in NAMES:
            torch.testing.assert_close(rows[name], expected_rows[name], **CLOSE)


def test_resume_rewrites_a_truncated_shard(model, prompts, tmp_path, monkeypatch, capsys):
    out, whole = tmp_path / "store", tmp_path / "whole"
    assert cache(prompts, out) == 0
    shutil.copytree(out, whole)
    manifest, _ = stored(out)
    assert len(manifest["shards"]) >= 3
    truncate(out / "shard-00001.safetensors")

    ran = counting_runs(model, monkeypatch)
    capsys.readouterr()
    assert cache(prompts, out) == 0
    assert "shard-00001.safetensors fails its check" in capsys.readouterr().out
    assert ran == shard_tokens(manifest, 1)  # only the damaged shard's prompts run again
    assert_same_store(out, whole)


def test_verify_names_the_damaged_shards(model, prompts, tmp_path, capsys):
    out = tmp_path / "store"
    cache(prompts, out)
    capsys.readouterr()
    assert verify(out) == 0
    assert "every shard passes its check" in capsys.readouterr().out

    truncate(out / "shard-00000.safetensors")
    flipped = bytearray((out / "shard-00001.safetensors").read_bytes())
    flipped[-1] ^= 1
    (out / "shard-00001.safetensors").write_bytes(flipped)
    (out / "shard-00002.safetensors").unlink()
    before = {path.name: path.read_bytes() for path in out.iterdir()}

    assert verify(out) == 1
    report = capsys.readouterr().out.splitlines()
    assert any(line.startswith("shard-00000.safetensors: ") and "bytes, the manifest records"
               in line for line in report)
    assert "shard-00001.safetensors: its sha256 differs from the manifest's" in report
    assert "shard-00002.safetensors: missing" in report
    assert report[-1].startswith("3 of ")
    assert {path.name: path.read_bytes() for path in out.iterdir()} == before  # it only reads


def test_old_manifest_without_checksums_resumes(model, prompts, tmp_path, monkeypatch, capsys):
    """Shards an older manifest recorded without checksums are checked for readability; a resume
    rewrites an unreadable one and records every shard's size and sha256."""
    out, whole = tmp_path / "store", tmp_path / "whole"
    cache(prompts, out)
    shutil.copytree(out, whole)
    manifest = json.loads((out / "manifest.json").read_text())
    for shard in manifest["shards"]:
        del shard["bytes"], shard["sha256"]
    (out / "manifest.json").write_text(json.dumps(manifest))
    truncate(out / "shard-00001.safetensors")

    capsys.readouterr()
    assert verify(out) == 1
    report = capsys.readouterr().out
    assert "shard-00001.safetensors: unreadable" in report
    assert "have no recorded checksums" in report

    ran = counting_runs(model, monkeypatch)
    assert cache(prompts, out) == 0
    assert ran == shard_tokens(manifest, 1)
    assert_same_store(out, whole)
    assert verify(out) == 0


def one_line_error(*argv: str) -> str:
    """The message of a command that must fail with one line and no traceback."""
    with pytest.raises(SystemExit) as failure:
        cli.main(list(argv))
    message = failure.value.code
    assert isinstance(message, str) and "\n" not in message, message
    return message


def manifest_text(*absent: str, **fields: object) -> str:
    """A one-shard manifest, less the ``absent`` fields, with others replaced by ``fields``."""
    manifest = {"format": FORMAT, "model": "m", "dtype": "float32", "max_new_tokens": 0,
                "names": {"hook_embed": {"shape": [128], "dtype": "float32"}},
                "shards": [{"file": "shard-00000.safetensors", "rows": 4}],
                "prompts": [{"shard": 0, "start": 0, "stop": 4, "prompt_length": 4,
                             "tokens": [1, 2, 3, 4]}]}
    return json.dumps({k: v for k, v in {**manifest, **fields}.items() if k not in absent})


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ('{"format": "vlens-activations/1", "model": "/m', "is not valid JSON"),
        (manifest_text("shards", "prompts"), "the manifest lacks shards, prompts"),
        (manifest_text(shards=[{"file": "shard-00000.safetensors"}]), "shard 0 lacks rows"),
        (manifest_text(shards=[{"file": "shard-00000.safetensors", "rows": 4, "bytes": 10}]),
         "shard 0 lacks sha256"),
        (manifest_text(prompts=[{"shard": 1, "start": 0, "stop": 4, "prompt_length": 4,
                                 "tokens": [1, 2, 3, 4]}]),
         "prompt 0 does not follow the previous rows of shard 1"),
        (manifest_text(format="vlens-activations/0"), "its format is 'vlens-activations/0'"),
    ],
)
def test_broken_manifest_is_one_line_naming_the_fix(no_engine, prompts, tmp_path, text, problem):
    assert manifest_problem(json.loads(manifest_text())) is None  # what each case breaks
    out = tmp_path / "store"
    out.mkdir()
    (out / "manifest.json").write_text(text)
    for argv in (["cache", "llama", "--prompts", str(prompts), "--names", "hook_embed",
                  "--out", str(out)], ["cache", "--verify", str(out)]):
        message = one_line_error(*argv)
        assert message.startswith(f"vlens cache: {out / 'manifest.json'} ")
        assert problem in message
        assert message.endswith("write the store again to an empty folder")


def test_out_that_cannot_be_a_store_folder(no_engine, prompts, tmp_path):
    file = tmp_path / "notes.txt"
    file.write_text("not a store")
    base = ["cache", "llama", "--prompts", str(prompts), "--names", "hook_embed", "--out"]
    for out in (file, file / "store"):  # the folder, or one above it, is a file
        message = one_line_error(*base, str(out))
        assert message == (f"vlens cache: {file} is a file, and a store is a folder: give a "
                           f"folder's path (a new one, or a store to resume)")
    assert file.read_text() == "not a store"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_out_not_writable(no_engine, prompts, tmp_path):
    out = tmp_path / "store"
    out.mkdir(mode=0o500)
    message = one_line_error("cache", "llama", "--prompts", str(prompts), "--names", "hook_embed",
                             "--out", str(out))
    assert message == (f"vlens cache: cannot write to {out} (Permission denied): give a folder "
                       f"you can write to")


def test_verify_takes_a_store_alone(no_engine, tmp_path, capsys):
    with pytest.raises(SystemExit) as mixed:
        cli.main(["cache", "llama", "--verify", str(tmp_path)])
    with pytest.raises(SystemExit) as missing:
        cli.main(["cache", "llama", "--names", "hook_embed"])
    assert mixed.value.code == missing.value.code == 2  # argparse's usage errors
    errors = capsys.readouterr().err
    assert "--verify DIR checks a store and takes no other arguments" in errors
    assert "required: --prompts, --out (or --verify DIR alone)" in errors
    assert one_line_error("cache", "--verify", str(tmp_path)) == (
        f"vlens cache: {tmp_path} has no manifest.json: it is not a vlens store, or no shard was "
        f"written yet"
    )


def test_shard_without_checksums_must_hold_the_manifest_names_and_rows(tmp_path):
    path = tmp_path / "shard-00000.safetensors"
    save_file({"hook_embed": torch.zeros(3, 4)}, path)
    record = {"file": path.name, "rows": 3}
    assert shard_problem(path, record, ["hook_embed"]) is None
    assert shard_problem(path, {**record, "rows": 4}, ["hook_embed"]) == (
        "hook_embed does not have the manifest's 4 rows"
    )
    assert shard_problem(path, record, ["hook_embed", "blocks.0.hook_z"]) == (
        "holds ['hook_embed'], not the manifest's names"
    )
