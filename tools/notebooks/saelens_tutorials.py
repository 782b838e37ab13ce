"""Run SAELens's tutorials cell by cell on SAELens's ``HookedSAETransformer`` or on vlens.

    .venv-saelens/bin/python tools/notebooks/saelens_tutorials.py --backend saelens
    .venv-saelens/bin/python tools/notebooks/saelens_tutorials.py --backend vlens
    .venv-saelens/bin/python tools/notebooks/saelens_tutorials.py tutorial_2_0 --backend vlens --cells 0-13

Runs in SAELens's environment (TransformerLens 3, sae-lens 6, vlens installed beside them). The
cells run through :class:`run_notebook.Runner` (statuses, display stubs, magics dropped); only
the loading lines change:

- every model load (``HookedSAETransformer.from_pretrained(...)``, ``HookedTransformer...``) gets
  SmolLM2-135M (``smollm2_path()``, fp32, unprocessed): ``saelens`` builds SAELens's
  ``HookedSAETransformer`` from the checkpoint with no weight processing
  (``parity.sae_model_reference.load_model``); ``vlens`` loads
  ``HookedVLLM.from_pretrained(path, dtype="float32", max_model_len=512, kv_cache_memory_bytes=256 MiB)``;
- ``SAE.from_pretrained(release, sae_id)`` and ``SAE.from_pretrained_with_cfg_and_sparsity``
  read a folder that SAELens itself wrote (seeded random weights, SAELens's format, one per
  release and id, under ``--sae-root``): ``sae_lens.SAE.load_from_disk`` on ``saelens``,
  ``vlens.sae.SAE.load_from_disk`` on ``vlens``;
- ``load_dataset(...)`` and ``ActivationsStore.from_sae(dataset=...)`` get a small local text
  list (:func:`local_texts`);
- network calls (``requests``, Neuronpedia's quick list, ``nltk.download``) raise
  :class:`run_notebook.NeedsNetwork`: the statement is ``skipped``, the cell's others still run.

After each cell the tensors and numbers it bound are recorded (a subsample of at most
:data:`recorded_values.KEPT` values each) in ``<values>/<backend>-<tutorial>.pt``; the ``vlens`` report compares
them with ``saelens``'s record of the same tutorial (relative difference, ``max|a-b| / max|b|``).
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent.parent))  # the repository root, for parity/

from notebook_cells import (  # noqa: E402
    LOAD_FUNCTION,
    Notebook,
    Tracked,
    code_sources,
    drop_magics,
    first_line,
    from_mirror,
    prepare,
)
from recorded_values import Recording, numbers_markdown, recorded_report  # noqa: E402
from run_notebook import (  # noqa: E402
    RESULTS,
    ModelSlot,
    NeedsNetwork,
    markdown,
    parse_cells,
    progress_printer,
    settle_environment,
    smollm2,
    write,
)

MIRROR = Path("/work/.mirror/jbloomAus+SAELens/repo")
COPIES = Path("/tmp/saelens_notebooks")
SAE_ROOT = Path("/tmp/saelens_tutorial_saes")
VALUES = Path("/tmp/saelens_tutorial_values")
BACKENDS = ("saelens", "vlens")
TUTORIALS = (
    "basic_loading_and_analysing",
    "logits_lens_with_features",
    "using_an_sae_as_a_steering_vector",
    "tutorial_2_0",
    "evaluating_saes_with_sae_lens_evals",
    "Hooked_SAE_Transformer_Demo",
)
SAE_FUNCTION = "__tutorial_sae__"
DATASET_FUNCTION = "__tutorial_dataset__"
NETWORK_FUNCTION = "__tutorial_network__"

# ---- the SAEs the tutorials name ---------------------------------------------------------------


@dataclass(frozen=True)
class SAESpec:
    release: str
    sae_id: str
    hook_name: str
    d_sae: int


def _resid(release: str, kind: str, layers: range | list[int], d_sae: int) -> list[SAESpec]:
    return [
        SAESpec(release, f"blocks.{i}.{kind}", f"blocks.{i}.{kind}", d_sae) for i in layers
    ]


#: Per tutorial: the releases and ids it loads, as the hook they read, and the width. Widths
#: keep the feature indices the tutorials hard-code (16873, 20115, 24185) in range; the logit
#: lens's twelve SAEs are narrower (each ``W_dec @ W_U`` is ``d_sae x 49152``), and the hook_z
#: SAEs of the HookedSAETransformer demo too (it loops over every live feature).
SAES: dict[str, list[SAESpec]] = {
    "basic_loading_and_analysing": _resid("gpt2-small-res-jb", "hook_resid_pre", [8], 24576),
    "logits_lens_with_features": _resid("gpt2-small-res-jb", "hook_resid_pre", range(12), 1024),
    "using_an_sae_as_a_steering_vector": _resid("gemma-2b-res-jb", "hook_resid_post", [6], 24576),
    "tutorial_2_0": _resid("gpt2-small-res-jb", "hook_resid_pre", [7], 24576),
    "Hooked_SAE_Transformer_Demo": [
        SAESpec("gpt2-small-hook-z-kk", f"blocks.{i}.hook_z", f"blocks.{i}.attn.hook_z", 64)
        for i in range(12)
    ],
}
#: Tokens per row of the local dataset (the SAEs' ``metadata.context_size``).
CONTEXT_SIZE = 32


def sae_folder(root: Path, tutorial: str, release: str, sae_id: str) -> Path:
    return root / tutorial / release / sae_id


def write_saes(root: Path, tutorial: str, d_in: int = 576) -> None:
    """SAELens writes each SAE the tutorial names (seeded random weights), once."""
    import safetensors.torch
    import torch
    from sae_lens import SAE
    from sae_lens.saes import StandardSAEConfig

    for number, spec in enumerate(SAES.get(tutorial, [])):
        folder = sae_folder(root, tutorial, spec.release, spec.sae_id)
        if (folder / "cfg.json").is_file():
            continue
        hook_z = spec.hook_name.endswith("hook_z")
        cfg = StandardSAEConfig(
            d_in=d_in, d_sae=spec.d_sae, reshape_activations="hook_z" if hook_z else "none"
        )
        cfg.metadata.hook_name = spec.hook_name
        cfg.metadata.model_name = "SmolLM2-135M-Instruct"
        cfg.metadata.context_size = CONTEXT_SIZE
        cfg.metadata.prepend_bos = True
        cfg.metadata.dataset_path = "local-texts"
        sae = SAE.from_dict(cfg.to_dict())
        generator = torch.Generator().manual_seed(1000 + number)
        with torch.no_grad():
            w_dec = torch.randn(spec.d_sae, d_in, generator=generator)
            w_dec /= w_dec.norm(dim=-1, keepdim=True)
            sae.W_dec.copy_(w_dec)
            sae.W_enc.copy_(w_dec.T * 0.1)
            sae.b_enc.copy_(-0.05 * torch.rand(spec.d_sae, generator=generator))
            sae.b_dec.copy_(0.01 * torch.randn(d_in, generator=generator))
        folder.mkdir(parents=True, exist_ok=True)
        sae.save_model(str(folder))
        log_sparsity = -1.0 - 8.0 * torch.rand(spec.d_sae, generator=generator)
        safetensors.torch.save_file({"sparsity": log_sparsity}, str(folder / "sparsity.safetensors"))


class SAESlot:
    """What the tutorials' ``SAE.from_pretrained...`` calls return on the backend."""

    def __init__(self, backend: str, root: Path, tutorial: str) -> None:
        self.backend, self.root, self.tutorial = backend, root, tutorial

    def __call__(
        self, method: str, release: str | None = None, sae_id: str | None = None, **kwargs: Any
    ) -> Any:
        import safetensors.torch

        folder = sae_folder(self.root, self.tutorial, str(release), str(sae_id))
        if not (folder / "cfg.json").is_file():
            raise NeedsNetwork(f"SAE.{method}({release!r}, {sae_id!r}): no local folder")
        if self.backend == "vlens":
            from vlens.sae import SAE as VlensSAE

            sae = VlensSAE.load_from_disk(str(folder))
        else:
            from sae_lens import SAE

            sae = SAE.load_from_disk(str(folder))
        if method != "from_pretrained_with_cfg_and_sparsity":
            return sae
        cfg = json.loads((folder / "cfg.json").read_text())
        sparsity = safetensors.torch.load_file(str(folder / "sparsity.safetensors"))["sparsity"]
        return sae, cfg, sparsity


# ---- the local dataset -------------------------------------------------------------------------


def local_texts() -> list[str]:
    """Plain English prose that ships with Python: the standard library's module docstrings."""
    import importlib

    names = (
        "argparse", "asyncio", "base64", "bisect", "calendar", "collections", "csv", "dataclasses",
        "decimal", "difflib", "email", "fractions", "functools", "heapq", "http", "inspect",
        "json", "logging", "mailbox", "os", "pathlib", "pickle", "random", "re", "shutil",
        "socket", "sqlite3", "statistics", "string", "subprocess", "tarfile", "textwrap",
        "threading", "typing", "unittest", "urllib", "uuid", "warnings", "zipfile",
    )  # fmt: skip
    texts = []
    for name in names:
        doc = importlib.import_module(name).__doc__ or ""
        text = " ".join(doc.split())
        if len(text) > 200:
            texts.append(text)
    return texts


def local_dataset(*args: Any, **kwargs: Any) -> Any:
    """``load_dataset(...)`` of any name: :func:`local_texts` as a ``datasets.Dataset``."""
    from datasets import Dataset

    return Dataset.from_dict({"text": local_texts() * 4})


def no_network(call: str) -> None:
    raise NeedsNetwork(f"{call} reaches the network")


# ---- the loading lines, rewritten --------------------------------------------------------------

SAE_METHODS = {"from_pretrained", "from_pretrained_with_cfg_and_sparsity"}
NETWORK_CALLS = {"requests.get", "requests.post", "get_neuronpedia_quick_list", "nltk.download"}


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


class SwapTutorialLoading(ast.NodeTransformer):
    """SAE loads to :data:`SAE_FUNCTION`, dataset loads to :data:`DATASET_FUNCTION`, network
    calls to :data:`NETWORK_FUNCTION` (model loads are left to ``notebook_cells``)."""

    def visit_Call(self, node: ast.Call) -> ast.AST:
        self.generic_visit(node)
        name = _dotted(node.func)
        owner, _, method = name.rpartition(".")
        if owner == "SAE" and method in SAE_METHODS:
            args = [ast.Constant(method), *node.args]
            return ast.Call(ast.Name(SAE_FUNCTION, ast.Load()), args, node.keywords)
        if name == "load_dataset":
            return ast.Call(ast.Name(DATASET_FUNCTION, ast.Load()), node.args, node.keywords)
        if name == "ActivationsStore.from_sae":
            for keyword in node.keywords:
                if keyword.arg == "dataset":
                    keyword.value = ast.Call(
                        ast.Name(DATASET_FUNCTION, ast.Load()), [keyword.value], []
                    )
        if name in NETWORK_CALLS:
            return ast.Call(ast.Name(NETWORK_FUNCTION, ast.Load()), [ast.Constant(name)], [])
        return node


def rewrite(source: str) -> str:
    try:
        tree = ast.parse(drop_magics(source))
    except SyntaxError:
        return source  # prepare() reports it
    return ast.unparse(ast.fix_missing_locations(SwapTutorialLoading().visit(tree)))


def read_tutorial(name: str, mirror: Path = MIRROR) -> tuple[str, dict]:
    """The tutorial at the SAELens mirror's HEAD (copied to :data:`COPIES`), else the copy."""
    copy = COPIES / f"{name}.ipynb"
    found = from_mirror(mirror, f"tutorials/{name}.ipynb")
    if found is not None:
        text, commit = found
        COPIES.mkdir(parents=True, exist_ok=True)
        copy.write_text(text)
        return f"jbloomAus/SAELens@{commit}:tutorials/{name}.ipynb", json.loads(text)
    if copy.is_file():
        return str(copy), json.loads(copy.read_text())
    raise FileNotFoundError(f"{name}: not tutorials/{name}.ipynb in {mirror}, nor in {COPIES}")


def load_tutorial(name: str, mirror: Path = MIRROR) -> Notebook:
    origin, raw = read_tutorial(name, mirror)
    tracked = Tracked()
    cells = []
    for index, source in enumerate(code_sources(raw)):
        cell = prepare(index, rewrite(source), tracked)
        cell.first_line = first_line(source)
        cells.append(cell)
    return Notebook(name, origin, cells)


# ---- the backends ------------------------------------------------------------------------------


def load_saelens(path: Path) -> Any:
    from parity.sae_model_reference import load_model

    return load_model(path)[0]


def load_vlens(path: Path) -> Any:
    from vlens import HookedVLLM

    return HookedVLLM.from_pretrained(
        str(path), dtype="float32", max_model_len=512, kv_cache_memory_bytes=256 * 2**20
    )


class TutorialModel(ModelSlot):
    """Every model a tutorial loads is SmolLM2 on the backend; torch's generator is seeded once
    it is loaded, so the tutorials' random feature picks match across backends."""

    def __call__(self, loader: str, name: Any = None, *args: Any, **kwargs: Any) -> Any:
        import torch

        self.name = self.name or str(kwargs.get("model_name", name))
        if self.model is None:
            start = time.perf_counter()
            self.model = (load_vlens if self.backend == "vlens" else load_saelens)(self.path)
            self.load_seconds = time.perf_counter() - start
        else:
            self.model.reset_hooks(including_permanent=True)
        torch.manual_seed(0)
        return self.model


class TutorialRunner(Recording):
    """:class:`run_notebook.Runner` with the tutorials' loaders, recording each cell's values."""

    def __init__(
        self, notebook: Notebook, backend: str, path: Path, timeout: float, sae_root: Path
    ) -> None:
        super().__init__(notebook, backend, path, timeout)
        self.slot = TutorialModel(backend, path)
        self.namespace.update(
            {
                LOAD_FUNCTION: self.slot,
                SAE_FUNCTION: SAESlot(backend, sae_root, notebook.name),
                DATASET_FUNCTION: local_dataset,
                NETWORK_FUNCTION: no_network,
            }
        )
        self.namespace.pop("HookedTransformer")  # TransformerLens 3 has it
        sys.modules["plotly_express"] = sys.modules["plotly.express"]  # stubbed by Runner


# ---- command line ------------------------------------------------------------------------------


def run_one(args: argparse.Namespace, name: str) -> dict[str, Any]:
    notebook = load_tutorial(name, args.mirror)
    path = args.model or smollm2()
    write_saes(args.sae_root, notebook.name)
    runner = TutorialRunner(notebook, args.backend, path, args.cell_timeout, args.sae_root)
    results = runner.run(parse_cells(args.cells), progress_printer(args.backend, notebook))
    report = recorded_report(runner, notebook, results, path, args, "saelens", "SAELens")
    report["saes"] = [asdict(spec) | {"d_in": 576} for spec in SAES.get(notebook.name, [])]
    report["environment"]["versions"]["sae-lens"] = metadata.version("sae-lens")
    return report


def arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tutorials", nargs="*", default=list(TUTORIALS))
    parser.add_argument("--backend", choices=BACKENDS, required=True)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--mirror", type=Path, default=MIRROR, help="SAELens git dir")
    parser.add_argument("--model", type=Path, default=None, help="default: smollm2_path()")
    parser.add_argument("--sae-root", type=Path, default=SAE_ROOT)
    parser.add_argument("--values", type=Path, default=VALUES)
    parser.add_argument("--cell-timeout", type=float, default=300.0)
    parser.add_argument("--cells", default=None, help="run only these cells, e.g. 0-15,18")
    parser.add_argument("--threads", type=int, default=1)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = arguments(argv)
    if len(args.tutorials) > 1:  # one process per tutorial
        own = [a for a in (argv if argv is not None else sys.argv[1:]) if a not in args.tutorials]
        codes = [
            subprocess.run([sys.executable, __file__, name, *own], check=False).returncode
            for name in args.tutorials
        ]
        return max(codes)
    settle_environment(ci=True, threads=args.threads)
    report = run_one(args, args.tutorials[0])
    json_path, md_path = write(report, args.out)
    md_path.write_text(markdown(report) + numbers_markdown(report.get("numbers", []), "SAELens"))
    print(f"{report['notebook']} on {report['backend']}: {report['summary']}\n  {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
