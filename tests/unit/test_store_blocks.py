"""A blocked store's pieces without Ray or an engine: cutting a prompt file into blocks by bytes,
its index and what a resume accepts, and the inputs ``vlens cache --ray`` refuses before Ray
starts (with the single-engine path's errors)."""

from __future__ import annotations

import itertools
import json

import pytest

from vlens import cli
from vlens.names.resolve import UnknownHookName
from vlens.store.blocks import INDEX, block_prompts_of, cut_prompt_file
from vlens.store.inputs import read_prompts
from vlens.store.manifest import StoreError
from vlens.store.on_ray import Workers, _pool, write_activations_on_ray
from vlens.testing.tiny import tiny_model

NAMES = ["blocks.*.hook_resid_post"]


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    lines = [json.dumps({"text": f"prompt {i} é"}) if i % 4 else json.dumps({"tokens": [1, i]})
             for i in range(11)]
    lines.insert(3, "")
    lines.insert(7, "  ")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.mark.parametrize("size", [1, 3, 4, 11, 50])
def test_blocks_hold_the_file_prompts_in_order(prompts, size):
    prompt_file, blocks = cut_prompt_file(prompts, size)
    expected = list(read_prompts(prompts))
    assert prompt_file.prompts == len(expected) == 11
    assert prompt_file.bytes == prompts.stat().st_size
    assert [block.count for block in blocks] == [min(size, 11 - i) for i in range(0, 11, size)]
    assert [block.first for block in blocks] == list(range(0, 11, size))
    got = list(itertools.chain.from_iterable(block_prompts_of(prompts, b) for b in blocks))
    assert got == expected


def test_a_bad_line_is_refused_with_its_number(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"text": "fine"}\n\n{"text": 3}\n')
    with pytest.raises(StoreError, match=r"prompts.jsonl:3: expected an object"):
        cut_prompt_file(path, 2)


def run(prompts, out, names=NAMES, **options):
    return write_activations_on_ray(tiny_model("llama"), prompts, names, out, progress=False,
                                    block_prompts=4, **options)


@pytest.mark.parametrize(
    ("names", "error", "message"),
    [(["blocks.*.hook_resid_pots"], UnknownHookName, "no hook name of this model matches"),
     (["blocks.9.hook_resid_post"], UnknownHookName, "blocks.9.hook_resid_post"),
     (["blocks.0.attn.hook_pattern"], StoreError, "only token-major names")],
)
def test_bad_names_are_refused_before_ray(prompts, tmp_path, names, error, message):
    with pytest.raises(error, match=message):
        run(prompts, tmp_path / "out", names)
    assert not (tmp_path / "out").exists()


def test_a_resume_with_other_settings_or_prompts_is_refused(prompts, tmp_path, monkeypatch):
    out = tmp_path / "out"
    monkeypatch.setattr("vlens.store.on_ray._fill_on_ray", lambda *args: 0)  # no Ray, no engine
    with pytest.raises(StoreError, match="not complete after the run"):
        run(prompts, out)
    index = json.loads((out / INDEX).read_text())
    assert [block["count"] for block in index["blocks"]] == [4, 4, 3]
    with pytest.raises(StoreError, match=r"dtype 'float32' \(this run: 'bfloat16'\)"):
        run(prompts, out, dtype="bfloat16")
    with pytest.raises(StoreError, match=r"block_prompts 4 \(this run: 5\)"):
        write_activations_on_ray(tiny_model("llama"), prompts, NAMES, out, block_prompts=5,
                                 progress=False)
    prompts.write_text(prompts.read_text() + '{"text": "one more"}\n')
    with pytest.raises(StoreError, match=r"the prompt file .*\(11 prompts.*this run's: 12 prompts"):
        run(prompts, out)


def test_a_single_engine_store_or_a_file_is_not_a_blocked_store(prompts, tmp_path):
    (tmp_path / "single").mkdir()
    (tmp_path / "single" / "manifest.json").write_text("{}")
    with pytest.raises(StoreError, match="single-engine store"):
        run(prompts, tmp_path / "single")
    (tmp_path / "file").write_text("")
    with pytest.raises(StoreError, match="is a file"):
        run(prompts, tmp_path / "file")


def test_a_pool_the_cluster_cannot_hold_is_refused():
    cpus = {"CPU": 2.0}
    assert _pool(cpus, Workers(count=2, cpus=0.5)) == (2, 0.0)
    assert _pool({"CPU": 16.0, "GPU": 8.0}, Workers()) == (8, 1.0)
    assert _pool({"CPU": 16.0, "GPU": 8.0}, Workers(tensor_parallel_size=2)) == (4, 2.0)
    with pytest.raises(StoreError, match="Ray Data needs some for its own tasks"):
        _pool(cpus, Workers(count=2, cpus=1))
    with pytest.raises(StoreError, match="need 4 GPUs, and the Ray cluster has 2"):
        _pool({"CPU": 16.0, "GPU": 2.0}, Workers(count=4))


def test_ray_options_need_ray(prompts, tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli.main(["cache", "llama", "--prompts", str(prompts), "--names", *NAMES, "--out",
                  str(tmp_path / "out"), "--workers", "2"])
    assert "--workers set how Ray runs the workers: add --ray" in capsys.readouterr().err
