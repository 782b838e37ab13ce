"""``vlens cache --ray`` on a local Ray cluster started by the tests: the blocks two workers write
hold the rows one engine stores, a worker killed in the middle of a block costs only that block,
and a run stopped and started again skips what is complete. Ray and its engines start slowly
(tens of seconds on two cores), so these tests are few and share one cluster."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import ray
import torch
from conftest import engine_args_of_tests
from datasets import load_from_disk
from test_cli import stored

from vlens import cli
from vlens.store.activations import write_activations
from vlens.store.blocks import INDEX, LOCK, index_blocks, read_index, verify_blocks_report
from vlens.store.inputs import read_prompts
from vlens.store.on_ray import Workers, write_activations_on_ray
from vlens.store.saelens import write_saelens_dataset
from vlens.testing.tiny import tiny_model

PATTERNS = ["hook_embed", "blocks.*.hook_resid_post", "blocks.1.attn.hook_z"]
WORDS = "the river ran past an old mill where children played in summer and snow fell".split()
# Fractional CPUs: on a two-core machine, workers of one CPU each would leave Ray Data none; on a
# machine with one GPU, the two share it.
TWO_WORKERS = Workers(count=2, gpus=0.5 if torch.cuda.is_available() else 0, cpus=0.5)


@pytest.fixture(scope="module")
def cluster():
    """A Ray of four logical CPUs on this machine; Ray Data starts a run once its whole actor
    pool is up, so that every worker gets blocks."""
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    ray.data.DataContext.get_current().wait_for_min_actors_s = 600
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


def write_prompts(path: Path, count: int) -> Path:
    texts = [" ".join(WORDS[i % 5 : i % 5 + 3 + i % 7]) for i in range(count)]
    path.write_text("\n".join(texts) + "\n")
    return path


def prompt_rows(folder: Path) -> list[tuple[list[int], dict[str, torch.Tensor]]]:
    """Every prompt of a store, single or blocked, in order: its tokens and its rows."""
    index = folder / INDEX
    parts = ([folder / block.folder for block in index_blocks(read_index(folder))]
             if index.exists() else [folder])
    rows = []
    for part in parts:
        manifest, values = stored(part)
        rows += [(prompt["tokens"], row) for prompt, row in zip(manifest["prompts"], values)]
    return rows


def test_two_workers_store_the_rows_of_one_engine(cluster, hooked, tmp_path):
    prompts = write_prompts(tmp_path / "prompts.txt", 12)
    single, blocked = tmp_path / "single", tmp_path / "blocked"
    write_activations(hooked("llama"), read_prompts(prompts), PATTERNS, single, batch_size=3,
                      shard_tokens=20, progress=False)
    run = write_activations_on_ray(
        tiny_model("llama"), prompts, PATTERNS, blocked, workers=TWO_WORKERS, block_prompts=3,
        batch_size=3, shard_tokens=20, engine_args=engine_args_of_tests(), progress=False,
    )
    assert (run.blocks, run.filled, run.prompts) == (4, 4, 12)
    expected, got = prompt_rows(single), prompt_rows(blocked)
    assert run.rows == sum(len(tokens) for tokens, _ in expected)
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected]
    for (_, got_rows), (_, expected_rows) in zip(got, expected, strict=True):
        assert got_rows.keys() == expected_rows.keys()
        for name, value in expected_rows.items():
            assert torch.equal(got_rows[name], value), name  # the same batches: the same bytes
    writers = {(blocked / f"block-{i:05d}" / LOCK).read_text() for i in range(4)}
    assert len(writers) == 2  # both workers wrote blocks
    assert cli.main(["cache", "--verify", str(blocked)]) == 0
    # SAELens's dataset of the blocks is the single store's
    datasets = [write_saelens_dataset(store, context_size=3) for store in (single, blocked)]
    assert datasets[0].contexts == datasets[1].contexts == 12
    expected, got = (load_from_disk(str(dataset.folder)).with_format("torch")
                     for dataset in datasets)
    for column in expected.column_names:
        assert torch.equal(got[:][column], expected[:][column]), column


def test_a_lost_worker_or_run_costs_only_its_blocks(cluster, hooked, tmp_path):
    """A run whose driver is killed, started again: the complete blocks are kept as they are; in
    the second run a worker is killed in the middle of a block, which another worker finishes.
    Every prompt ends stored once, and every block passes --verify."""
    prompts = write_prompts(tmp_path / "prompts.txt", 24)
    out = tmp_path / "out"
    options = ["--names", *PATTERNS, "--out", str(out), "--block-prompts", "6", "--batch-size",
               "2", "--shard-tokens", "8"]
    command = [sys.executable, "-m", "vlens.cli", "cache", str(tiny_model("llama")),
               "--prompts", str(prompts), "--ray", cluster, "--workers", "1",
               "--cpus-per-worker", "0.5", *options]
    driver = subprocess.Popen(command, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
    first = out / "block-00000" / "manifest.json"
    deadline = time.monotonic() + 300
    while not (first.exists() and len(json.loads(first.read_text())["prompts"]) == 6):
        assert driver.poll() is None, driver.stderr.read()
        assert time.monotonic() < deadline, "the first block was never completed"
        time.sleep(0.05)
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    kept = {path: path.stat().st_mtime_ns for path in (out / "block-00000").iterdir()
            if path.name != LOCK}

    killed = []

    def kill_a_worker_mid_block() -> None:
        while not killed and time.monotonic() < deadline:
            for block in sorted(out.glob("block-*"))[1:]:
                manifest = block / "manifest.json"
                stored = len(json.loads(manifest.read_text())["prompts"]) if manifest.exists() else 0
                if 0 < stored < 6:
                    pid = int((block / LOCK).read_text())
                    os.kill(pid, signal.SIGKILL)
                    killed.append((block.name, stored, pid))
                    return
            time.sleep(0.01)

    killer = threading.Thread(target=kill_a_worker_mid_block)
    killer.start()
    run = write_activations_on_ray(
        tiny_model("llama"), prompts, PATTERNS, out, workers=TWO_WORKERS, block_prompts=6,
        batch_size=2, shard_tokens=8, engine_args=engine_args_of_tests(), progress=False,
    )
    killer.join()
    assert killed, "no worker was caught in the middle of a block"
    name, _, pid = killed[0]
    assert int((out / name / LOCK).read_text()) != pid  # another worker finished it
    assert run.blocks == 4 and 1 <= 4 - run.filled  # block 0 was complete and verified
    assert {path: path.stat().st_mtime_ns for path in kept} == kept
    lines, passed = verify_blocks_report(out)
    assert passed, lines
    assert lines[-1] == "every block is complete and every shard passes its check"
    stored = [tokens for tokens, _ in prompt_rows(out)]
    assert stored == hooked("llama").token_lists(prompts.read_text().splitlines())  # once each
