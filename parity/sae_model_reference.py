"""Reference values for SAEs spliced into a model, computed by SAELens's ``HookedSAETransformer``.

For each case below this script loads a tiny random checkpoint into SAELens's
``HookedSAETransformer`` (through TransformerLens 3.9, with no weight processing: no folded
norms, no centring), attaches one or two SAEs read with SAELens's ``SAE.load_from_disk`` and
records what it computes on a short batch of tokens:

- ``tokens``: the token ids, ``[batch, pos]`` (int64), as TransformerLens's ``to_tokens`` makes
  them from the prompts (with its default ``prepend_bos``), each row cut to ``POSITIONS``;
- ``logits`` and ``cache.<name>``: ``run_with_cache_with_saes(tokens, saes=saes,
  use_error_term=False)``; ``<name>`` is every cached name containing ``hook_sae`` and the
  ``DOWNSTREAM`` names after the (deepest) SAE;
- ``error_term.logits``, ``error_term.cache.<name>``: the same with ``use_error_term=True``;
- ``edited.logits``, ``edited.cache.<name>``: with ``use_error_term=True`` and, on every SAE of
  the case, a forward hook on ``<hook_name>.hook_sae_acts_post`` that sets feature 3 to zero and
  multiplies feature 5 by 4 (``model.saes(...)`` around ``model.hooks(...)`` around
  ``run_with_cache``; the edit hook runs before the caching hook, so the cached
  ``hook_sae_acts_post`` is the edited one).

Every ``logits`` value is the last position's only, ``[batch, d_vocab]``; cached values are
whole, ``[batch, pos, ...]``. Everything is float32. Each value is stored once: a value
bit-identical to one stored before it (in the order plain, error_term, edited; e.g.
``error_term.cache.<hook>.hook_sae_acts_post``, the same as ``cache.<hook>.hook_sae_acts_post``)
is left out of the file, and ``case.json``'s ``same_as`` maps its key to the stored key, so
``ref[case["same_as"].get(key, key)]`` reads any key. They go to
``<out>/<case>/reference.safetensors`` (its safetensors metadata holds the SAELens,
TransformerLens, transformers and torch versions), and ``<out>/<case>/case.json`` says what was
run: the model family and folder name, how far TransformerLens's logits are from HuggingFace's on
the tokens, the prompts, the SAEs (folder relative to the case folder, architecture, hook name,
seed), the edit, which names each run's cache lacks or adds against a run without SAEs, how far
each run's logits are from the model's without SAEs, and the shape of every key.

The SAEs are ``random_sae``'s (d_sae 32, TopK k 8), its weight scales fixed; the seeds are
chosen so that features 3 and 5 of every SAE fire (at some of the positions, in most cases),
which the script checks, as it checks that the SAEs change the logits, that the error term
restores them and that the edit changes them again.

The SAE folders are ``<sae-dir>/<case>/sae/`` (the case ``gpt2_two_saes`` reuses two of the other
cases' SAEs); they and the tiny checkpoints are written by vlens (``random_sae`` and
``tiny_model`` from ``vlens.testing``), which is not installed beside SAELens. So there are two
steps, from the repository root: the first prints a short program that the repository's own
environment runs to write them, the second computes the references::

    /work/saelens-env/bin/python parity/sae_model_reference.py --emit-prepare \\
        | /work/main/.venv/bin/python -
    /work/saelens-env/bin/python parity/sae_model_reference.py

Options: ``--model-dir FAMILY=DIR`` (repeatable) names a checkpoint folder; by default it is
``$VLENS_CACHE/tiny/<family>-seed0-v1`` (``VLENS_CACHE`` defaulting to ``~/.cache/vlens``), where
``tiny_model(family)`` builds it. ``--sae-dir DIR`` is the root of the SAE folders (default: the
output root), ``--out DIR`` the output root (default ``parity/references/sae_model``) and
``--case NAME`` (repeatable) runs only the cases named. Nothing is downloaded: the checkpoints
are read from their folders with ``local_files_only``.

How the checkpoint becomes a ``HookedSAETransformer``: ``HookedTransformer.from_pretrained``
accepts only the official model names (it looks the name up before anything else), so the
script calls the two loading steps that ``from_pretrained`` runs,
``loading_from_pretrained.get_pretrained_model_config`` (which reads a local folder's
``config.json`` when given a path) and ``get_pretrained_state_dict`` (given the HuggingFace model,
it runs TransformerLens's weight conversion for the family), then builds the model and calls
``load_and_process_state_dict`` with every processing flag off, as
``from_pretrained_no_processing`` does. The config is read from a copy of ``config.json`` in a
folder named ``checkpoint``, because TransformerLens 3.9 picks the architecture from the path
when it contains ``llama`` or ``gemma`` (and then never reads the config); for gpt2 the copy
adds ``n_ctx`` (= ``n_positions``), which TransformerLens reads and transformers 5 no longer
derives. Before any SAE is attached, the script checks that the model's logits on the tokens
match the HuggingFace model's.

The committed references were made with sae-lens 6.54.12, transformer-lens 3.9.0,
transformers 5.24.0 and torch 2.13.0+cpu.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from sae_lens import SAE, HookedSAETransformer
from transformer_lens import loading_from_pretrained as loading
from transformer_lens.hook_points import HookPoint
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

D_SAE = 32
TOPK_K = 8
PROMPTS = ("The quick brown fox jumps over the lazy dog.", "Paris is the capital of France.")
POSITIONS = 4  # tokens kept per prompt (with the BOS that TransformerLens prepends, if any)
DOWNSTREAM = 2  # hook_resid_post names recorded after the deepest SAE
ZEROED_FEATURE, SCALED_FEATURE, SCALE = 3, 5, 4.0
TL_HF_TOLERANCE = 1e-4

ROOT = Path(__file__).resolve().parent / "references" / "sae_model"
CHECKPOINT_SUFFIX = "-seed0-v1"  # tiny_model(family)'s folder name: seed 0, recipe v1


@dataclass(frozen=True)
class SAESpec:
    """One SAE that ``random_sae`` writes to ``<sae-dir>/<folder>``."""

    folder: str
    architecture: str
    hook_name: str
    d_in: int
    seed: int
    family: str

    def layer(self) -> int:
        return int(self.hook_name.split(".")[1])


@dataclass(frozen=True)
class Case:
    name: str
    family: str
    saes: tuple[SAESpec, ...]


GPT2_STANDARD = SAESpec(
    "gpt2_standard_resid_post/sae", "standard", "blocks.0.hook_resid_post", 128, 19, "gpt2"
)
GPT2_JUMPRELU = SAESpec(
    "gpt2_jumprelu_mlp_out/sae", "jumprelu", "blocks.1.hook_mlp_out", 128, 14, "gpt2"
)
# hook_z: d_in = n_heads * d_head = 4 * 32.
GPT2_TOPK_Z = SAESpec("gpt2_topk_hook_z/sae", "topk", "blocks.0.attn.hook_z", 128, 29, "gpt2")
LLAMA_STANDARD = SAESpec(
    "llama_standard_resid_post/sae", "standard", "blocks.1.hook_resid_post", 128, 13, "llama"
)

CASES = (
    Case("gpt2_standard_resid_post", "gpt2", (GPT2_STANDARD,)),
    Case("gpt2_jumprelu_mlp_out", "gpt2", (GPT2_JUMPRELU,)),
    Case("gpt2_topk_hook_z", "gpt2", (GPT2_TOPK_Z,)),
    Case("gpt2_two_saes", "gpt2", (GPT2_STANDARD, GPT2_JUMPRELU)),
    Case("llama_standard_resid_post", "llama", (LLAMA_STANDARD,)),
)


def default_model_dir(family: str) -> Path:
    """Where ``vlens.testing.tiny_model(family)`` puts its checkpoint."""
    cache = Path(os.environ.get("VLENS_CACHE", Path.home() / ".cache" / "vlens"))
    return cache / "tiny" / f"{family}{CHECKPOINT_SUFFIX}"


def prepare_program(cases: list[Case], sae_dir: Path) -> str:
    """A program for the repository's environment that builds the tiny checkpoints and writes
    the random SAEs the cases read."""
    lines = [
        "from vlens.testing import tiny_model",
        "from vlens.testing.saes import random_sae",
        "",
    ]
    for family in dict.fromkeys(case.family for case in cases):
        lines.append(f"print(tiny_model({family!r}))")
    specs = dict.fromkeys(spec for case in cases for spec in case.saes)
    for spec in specs:
        folder = str(sae_dir / spec.folder)
        lines.append(
            f"print(random_sae({folder!r}, {spec.architecture!r}, d_in={spec.d_in}, "
            f"d_sae={D_SAE}, hook_name={spec.hook_name!r}, seed={spec.seed}, k={TOPK_K}, "
            f"model_name={'tiny-' + spec.family!r}))"
        )
    return "\n".join(lines) + "\n"


def tl_config_folder(model_dir: Path, tmp: Path) -> Path:
    """A copy of the checkpoint's ``config.json`` in a folder whose path TransformerLens will
    read the config from (see the module docstring)."""
    config = json.loads((model_dir / "config.json").read_text())
    if config.get("model_type") == "gpt2":
        config.setdefault("n_ctx", config["n_positions"])
    folder = tmp / "checkpoint"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    if any(word in str(folder).lower() for word in ("llama", "gemma")):
        raise RuntimeError(f"temporary folder {folder} would be read by name; set TMPDIR")
    return folder


def load_model(model_dir: Path) -> tuple[HookedSAETransformer, PreTrainedModel]:
    """The checkpoint as SAELens's HookedSAETransformer (unprocessed), and as HuggingFace's."""
    hf_model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, local_files_only=True
    ).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    with tempfile.TemporaryDirectory(prefix="tl-config-") as tmp:
        folder = str(tl_config_folder(model_dir, Path(tmp)))
        cfg = loading.get_pretrained_model_config(
            folder,
            hf_cfg=hf_model.config.to_dict(),
            fold_ln=False,
            device="cpu",
            dtype=torch.float32,
            local_files_only=True,
        )
        state_dict = loading.get_pretrained_state_dict(
            folder, cfg, hf_model=hf_model, dtype=torch.float32
        )
    model = HookedSAETransformer(cfg, tokenizer, move_to_device=False)
    model.load_and_process_state_dict(
        state_dict,
        fold_ln=False,
        center_writing_weights=False,
        center_unembed=False,
        fold_value_biases=False,
        refactor_factored_attn_matrices=False,
    )
    return model.eval(), hf_model


def tokenize(model: HookedSAETransformer) -> torch.Tensor:
    """Each prompt as TransformerLens tokenizes it, cut to ``POSITIONS`` (so that no row needs
    padding)."""
    rows = [model.to_tokens(prompt)[0, :POSITIONS] for prompt in PROMPTS]
    if any(len(row) < POSITIONS for row in rows):
        raise ValueError(f"a prompt has fewer than {POSITIONS} tokens")
    return torch.stack(rows).to(torch.int64)


def downstream_names(model: HookedSAETransformer, specs: tuple[SAESpec, ...]) -> list[str]:
    """The first ``DOWNSTREAM`` hook_resid_post names at or after the deepest SAE's block,
    leaving out the SAEs' own hooks (which SAELens's wrappers replace)."""
    hooks = {spec.hook_name for spec in specs}
    deepest = max(spec.layer() for spec in specs)
    names = [
        f"blocks.{layer}.hook_resid_post"
        for layer in range(deepest, model.cfg.n_layers)
        if f"blocks.{layer}.hook_resid_post" not in hooks
    ]
    return (names + ["ln_final.hook_normalized"])[:DOWNSTREAM]


def edit_features(acts: torch.Tensor, hook: HookPoint) -> torch.Tensor:
    """The forward hook of the edited run: feature 3 off, feature 5 times 4."""
    acts = acts.clone()
    acts[..., ZEROED_FEATURE] = 0.0
    acts[..., SCALED_FEATURE] *= SCALE
    return acts


@contextmanager
def edited(model: HookedSAETransformer, saes: list[SAE[Any]]) -> Iterator[HookedSAETransformer]:
    """The SAEs attached with their error terms, and every one's features edited."""
    hooks: list[tuple[str | Callable[..., Any], Callable[..., Any]]] = [
        (f"{sae.cfg.metadata.hook_name}.hook_sae_acts_post", edit_features) for sae in saes
    ]
    with model.saes(saes=saes, use_error_term=True), model.hooks(fwd_hooks=hooks):
        yield model


def record(
    case: Case, model: HookedSAETransformer, saes: list[SAE[Any]], tokens: torch.Tensor
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Every reference value of one case (by key, in the order plain, error_term, edited), and
    what case.json says about the runs."""
    downstream = downstream_names(model, case.saes)
    values: dict[str, torch.Tensor] = {"tokens": tokens}
    with torch.no_grad():
        clean_logits, clean_cache = model.run_with_cache(tokens)
        runs: dict[str, tuple[torch.Tensor, Any]] = {
            "": model.run_with_cache_with_saes(tokens, saes=saes, use_error_term=False),
            "error_term.": model.run_with_cache_with_saes(tokens, saes=saes, use_error_term=True),
        }
        with edited(model, saes):
            runs["edited."] = model.run_with_cache(tokens)
    diffs: dict[str, float] = {}
    names: dict[str, dict[str, list[str]]] = {}
    for prefix, (logits, cache) in runs.items():
        run = prefix.rstrip(".") or "plain"
        diffs[run] = (logits - clean_logits).abs().max().item()
        names[run] = {
            "missing": [name for name in clean_cache if name not in cache],
            "added": [name for name in cache if name not in clean_cache],
        }
        values[f"{prefix}logits"] = logits[:, -1, :]
        for name in cache:
            if "hook_sae" in name or name in downstream:
                values[f"{prefix}cache.{name}"] = cache[name]
    check(case, values, diffs)
    about = {
        "downstream_names": downstream,
        "cache_names_against_model_without_saes": names,
        "max_abs_logit_diff_from_model_without_saes": diffs,
    }
    return values, about


def deduplicate(values: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The values to store, each once: a value bit-identical to one stored before it is left
    out, and ``same_as`` maps its key to the stored key."""
    stored: dict[str, torch.Tensor] = {}
    same_as: dict[str, str] = {}
    for key, value in values.items():
        twin = next((k for k, v in stored.items() if _identical(v, value)), None)
        if twin is None:
            stored[key] = value.clone().contiguous()
        else:
            same_as[key] = twin
    return stored, same_as


def _identical(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def check(case: Case, values: dict[str, torch.Tensor], diffs: dict[str, float]) -> None:
    """What makes the references worth having: the features the edit touches fire, the edit
    and the SAEs change the logits, and the error term restores them."""
    for spec in case.saes:
        acts = values[f"cache.{spec.hook_name}.hook_sae_acts_post"]
        for feature in (ZEROED_FEATURE, SCALED_FEATURE):
            if not (acts[..., feature] != 0).any():
                raise AssertionError(f"{case.name}: feature {feature} of {spec.hook_name} is off")
    if not diffs["plain"] > 1e-3 or not diffs["error_term"] < 1e-4 or not diffs["edited"] > 1e-3:
        raise AssertionError(f"{case.name}: unexpected logit differences {diffs}")


def shapes(values: dict[str, torch.Tensor]) -> dict[str, list[int]]:
    return {name: list(value.shape) for name, value in values.items()}


def describe(case: Case, values: dict[str, torch.Tensor], tl_hf: float) -> str:
    lines = [f"{case.name}: TL vs HF logits max abs diff {tl_hf:.2e}"]
    for spec in case.saes:
        acts = values[f"cache.{spec.hook_name}.hook_sae_acts_post"]
        active = (acts != 0).sum(-1).tolist()
        lines.append(f"  {spec.hook_name} ({spec.architecture}) active per position {active}")
    return "\n".join(lines)


def case_info(
    case: Case,
    model: HookedSAETransformer,
    model_dir: Path,
    sae_dir: Path,
    case_dir: Path,
    tl_hf: float,
) -> dict[str, Any]:
    """What case.json says about the model, the tokens, the SAEs and the runs."""
    return {
        "family": case.family,
        "model_dir_name": model_dir.name,
        "tl_vs_hf_max_abs_logit_diff": tl_hf,
        "prompts": list(PROMPTS),
        "positions": POSITIONS,
        "prepend_bos": bool(model.cfg.default_prepend_bos),
        "bos_token_id": model.tokenizer.bos_token_id if model.tokenizer else None,
        "saes": [
            {
                "folder": os.path.relpath(sae_dir / spec.folder, case_dir),
                "architecture": spec.architecture,
                "hook_name": spec.hook_name,
                "d_in": spec.d_in,
                "d_sae": D_SAE,
                "seed": spec.seed,
                **({"k": TOPK_K} if spec.architecture == "topk" else {}),
            }
            for spec in case.saes
        ],
        "runs": {
            "plain": "run_with_cache_with_saes(tokens, saes=saes, use_error_term=False)",
            "error_term": "run_with_cache_with_saes(tokens, saes=saes, use_error_term=True)",
            "edited": "with saes(saes=saes, use_error_term=True), hooks(fwd_hooks=edit): "
            "run_with_cache(tokens)",
        },
        "edit": {
            "hooks": [f"{spec.hook_name}.hook_sae_acts_post" for spec in case.saes],
            "zeroed_feature": ZEROED_FEATURE,
            "scaled_feature": SCALED_FEATURE,
            "scale": SCALE,
        },
        "logits": "last position only: [batch, d_vocab]",
    }


def to_json(info: dict[str, Any]) -> str:
    """``info`` indented, with each list of numbers (a shape) on one line."""
    text = json.dumps(info, indent=2)
    numbers = re.compile(r"\[([-\d.e,\s]+)\]")
    return numbers.sub(lambda m: f"[{', '.join(n.strip() for n in m[1].split(','))}]", text) + "\n"


def parse_model_dirs(pairs: list[str]) -> dict[str, Path]:
    dirs: dict[str, Path] = {}
    for pair in pairs:
        family, sep, folder = pair.partition("=")
        if not sep:
            raise SystemExit(f"--model-dir takes FAMILY=DIR, got {pair!r}")
        dirs[family] = Path(folder)
    return dirs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--model-dir", action="append", default=[], metavar="FAMILY=DIR")
    parser.add_argument("--sae-dir", type=Path, default=None, help="default: --out")
    parser.add_argument("--out", type=Path, default=ROOT)
    parser.add_argument("--case", action="append", default=[], choices=[c.name for c in CASES])
    parser.add_argument(
        "--emit-prepare",
        action="store_true",
        help="print the program that builds the checkpoints and SAEs (for vlens's environment)",
    )
    args = parser.parse_args(argv)
    out: Path = args.out.resolve()
    sae_dir: Path = (args.sae_dir or args.out).resolve()
    cases = [case for case in CASES if not args.case or case.name in args.case]
    if args.emit_prepare:
        sys.stdout.write(prepare_program(cases, sae_dir))
        return 0

    warnings.simplefilter("ignore")  # TransformerLens's deprecation notices
    torch.set_num_threads(1)
    model_dirs = parse_model_dirs(args.model_dir)
    versions = {
        f"{package.replace('-', '_')}_version": importlib.metadata.version(package)
        for package in ("sae-lens", "transformer-lens", "transformers", "torch")
    }
    models: dict[str, tuple[HookedSAETransformer, PreTrainedModel]] = {}
    for case in cases:
        model_dir = model_dirs.get(case.family, default_model_dir(case.family))
        if not (model_dir / "config.json").is_file():
            raise SystemExit(f"no checkpoint in {model_dir}: run the --emit-prepare step first")
        if case.family not in models:
            models[case.family] = load_model(model_dir)
        model, hf_model = models[case.family]
        tokens = tokenize(model)
        with torch.no_grad():
            tl_hf = (model(tokens) - hf_model(tokens).logits).abs().max().item()
        if not tl_hf < TL_HF_TOLERANCE:
            raise AssertionError(f"{case.name}: TransformerLens and HuggingFace differ by {tl_hf}")

        case_dir = out / case.name
        case_dir.mkdir(parents=True, exist_ok=True)
        saes = [SAE.load_from_disk(sae_dir / spec.folder).eval() for spec in case.saes]
        values, about = record(case, model, saes, tokens)
        stored, same_as = deduplicate(values)
        safetensors.torch.save_file(
            stored, str(case_dir / "reference.safetensors"), metadata=versions
        )
        info = case_info(case, model, model_dir, sae_dir, case_dir, tl_hf)
        info.update(about, shapes=shapes(values), same_as=same_as, versions=versions)
        (case_dir / "case.json").write_text(to_json(info))
        print(describe(case, values, tl_hf))
    return 0


if __name__ == "__main__":
    sys.exit(main())
