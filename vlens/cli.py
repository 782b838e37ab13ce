"""The ``vlens`` command. With no arguments it shows the logit lens of the embedded default model
(SmolLM2-135M-Instruct) on "The capital of France is"."""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path

from transformers import AutoConfig

from vlens.analysis.lens import format_lens, logit_lens, plot_lens, require_matplotlib
from vlens.hooked.model import HookedVLLM
from vlens.mappings import checkpoint_specs
from vlens.names.mapping import Spec
from vlens.names.resolve import UnknownHookName
from vlens.store.activations import DTYPES, fill_store, open_store
from vlens.store.blocks import INDEX, verify_blocks_report
from vlens.store.inputs import count_prompts, read_prompts, stored_names
from vlens.store.manifest import StoreError, verify_report
from vlens.store.saelens import per_token_width_problem, write_saelens_dataset

DEFAULT_PROMPT = "The capital of France is"


def model_folder(name: str | None) -> Path:
    """A checkpoint folder, a tiny test model's name, or (None) the embedded SmolLM2."""
    if name is None:
        from vlens.testing.embedded import smollm2_path

        return smollm2_path()
    from vlens.testing.tiny import ARCHS, tiny_model

    if name in ARCHS:
        return tiny_model(name)
    if not Path(name).is_dir():
        raise SystemExit(
            f"vlens: {name!r} is neither a checkpoint folder nor a tiny model name "
            f"({', '.join(ARCHS)})"
        )
    return Path(name)


def names_command(args: argparse.Namespace) -> None:
    for name, spec in checkpoint_specs(model_folder(args.model)).items():
        print(f"{name:45} [batch {spec.shape}]")


def tree_command(args: argparse.Namespace) -> None:
    from vlens.engine.tree import weightless_model

    print(weightless_model(model_folder(args.model), max_model_len=args.max_model_len))


def lens_command(args: argparse.Namespace) -> None:
    if args.plot:
        try:
            require_matplotlib()  # before the engine loads, not after
        except ModuleNotFoundError as missing:
            raise SystemExit(f"vlens lens --plot: {missing}") from None
    folder = model_folder(args.model)
    context = min(1024, AutoConfig.from_pretrained(folder).max_position_embeddings)  # KV memory
    model = HookedVLLM.from_pretrained(folder, dtype="float32", max_model_len=context)
    view = logit_lens(model, args.prompt)
    print(f"Logit lens of {args.prompt!r}: the top next token at each layer (rows) and position")
    print(format_lens(view))
    print(f"\nThe model's prediction after the last token: {view.top_tokens[-1][-1]!r}")
    if args.plot:
        plot_lens(view, args.plot, title=f"Logit lens of {args.prompt!r} ({folder.name})")
        print(f"Plot written to {args.plot}")


def cache_command(args: argparse.Namespace) -> int | None:
    _require_cache_arguments(args)
    if args.verify:
        blocked = (args.verify / INDEX).is_file()
        lines, passed = (verify_blocks_report if blocked else verify_report)(args.verify)
        print("\n".join(lines))
        return 0 if passed else 1
    folder = model_folder(args.model)
    if not args.prompts.is_file():
        raise SystemExit(f"vlens cache: no prompt file at {args.prompts}")
    if args.ray is not None:
        return ray_cache_command(args, folder)
    # Bad names, a store made with other settings and a folder that cannot be written are
    # reported before the engine loads.
    specs = checkpoint_specs(folder)
    names = stored_names(args.names, specs)
    if args.format == "saelens":
        _require_saelens_names(names, specs)
    store = open_store(args.out, folder, names, args.dtype, args.max_new_tokens, progress=True)
    total = count_prompts(args.prompts)
    print(f"{len(names)} names, {total} prompts, {store.stored_prompts} already in {args.out}")
    for index, problem in sorted(store.damaged.items()):
        file = store.manifest["shards"][index]["file"]
        print(f"{file} fails its check ({problem}): rewriting it")
    if store.stored_prompts < total or store.damaged:
        model = HookedVLLM.from_pretrained(folder, dtype=args.dtype)
        store = fill_store(
            model,
            store,
            read_prompts(args.prompts),
            batch_size=args.batch_size,
            shard_tokens=args.shard_tokens,
            total=total,
        )
        shards = store.manifest["shards"] if store.manifest else []
        rows = sum(shard["rows"] for shard in shards)
        print(f"{store.stored_prompts} prompts, {rows} rows in {len(shards)} shards: {args.out}")
    if args.format == "saelens":
        saelens_command(args)
    return None


def ray_cache_command(args: argparse.Namespace, folder: Path) -> None:
    """``vlens cache --ray``: the store cut into blocks, filled by engines Ray Data schedules."""
    from vlens.store.on_ray import Workers, write_activations_on_ray

    if args.format == "saelens":
        specs = checkpoint_specs(folder)
        _require_saelens_names(stored_names(args.names, specs), specs)
    given = {"count": args.workers, "gpus": args.gpus_per_worker, "cpus": args.cpus_per_worker,
             "tensor_parallel_size": args.tensor_parallel_size}
    workers = Workers(**{key: value for key, value in given.items() if value is not None})
    block = {} if args.block_prompts is None else {"block_prompts": args.block_prompts}
    run = write_activations_on_ray(
        folder, args.prompts, args.names, args.out, address=args.ray or None, workers=workers,
        batch_size=args.batch_size, shard_tokens=args.shard_tokens, dtype=args.dtype,
        max_new_tokens=args.max_new_tokens, **block,
    )
    written = (f"{run.filled} written by this run in {run.seconds:.1f} s, "
               f"{run.tokens_per_second:,.0f} tokens/s" if run.filled else "all already complete")
    print(f"{run.prompts} prompts in {run.blocks} blocks ({written}): {args.out}")
    if args.format == "saelens":
        saelens_command(args)


def saelens_command(args: argparse.Namespace) -> None:
    """SAELens's dataset of the store just filled; its shards were checked or written by this
    run, so they are not hashed again."""
    dataset = write_saelens_dataset(
        args.out, context_size=args.context_size, check_shards=False, progress=True
    )
    widths = ", ".join(f"{name} (d_in {width})" for name, width in dataset.d_in.items())
    done = "written" if dataset.written else "already written for this store, kept"
    print(f"SAELens dataset {done}: {dataset.folder}, {dataset.contexts} contexts of "
          f"{dataset.context_size} tokens, {dataset.dtype}: {widths}")
    if dataset.rows_left_out:
        print(f"{dataset.rows_left_out} rows past the first {dataset.context_size} of longer "
              f"prompts are in the store but not in the dataset")


def _require_saelens_names(names: list[str], specs: dict[str, Spec]) -> None:
    """Before the engine loads: every name has one vector per token for SAELens's dataset."""
    for name in names:
        problem = per_token_width_problem(name, specs[name].shape.split()[1:])
        if problem:
            raise StoreError(f"{problem}; leave it out of --names with --format saelens")


def _require_cache_arguments(args: argparse.Namespace) -> None:
    """``--verify DIR`` alone, or a model with --prompts, --names and --out (argparse cannot say
    "required unless")."""
    writing = {"model": args.model, "--prompts": args.prompts, "--names": args.names,
               "--out": args.out}
    if args.verify and (any(writing.values()) or args.format != "vlens" or args.context_size
                        or args.ray is not None):
        args.usage_error("--verify DIR checks a store and takes no other arguments")
    ray_options = {"--workers": args.workers, "--gpus-per-worker": args.gpus_per_worker,
                   "--cpus-per-worker": args.cpus_per_worker,
                   "--tensor-parallel-size": args.tensor_parallel_size,
                   "--block-prompts": args.block_prompts}
    given = [option for option, value in ray_options.items() if value is not None]
    if args.ray is None and given:
        args.usage_error(f"{', '.join(given)} set how Ray runs the workers: add --ray")
    if args.context_size is not None and args.format != "saelens":
        args.usage_error("--context-size sets SAELens's contexts: it goes with --format saelens")
    if args.context_size is not None and args.context_size < 1:
        args.usage_error(f"--context-size must be positive, not {args.context_size}")
    missing = [name for name, value in writing.items() if not value]
    if not args.verify and missing:
        args.usage_error(f"the following arguments are required: {', '.join(missing)} "
                         f"(or --verify DIR alone)")


def parity_command(args: argparse.Namespace) -> int:
    from vlens.parity.__main__ import main as parity_main

    return parity_main([*args.models, *(["--out", str(args.out)] if args.out else [])])


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="vlens", description=__doc__)
    commands = root.add_subparsers(dest="command")

    names = commands.add_parser("names", help="list a model's hook names with their shapes")
    names.add_argument("model", nargs="?", help="checkpoint folder or tiny model name")
    names.set_defaults(run=names_command)

    tree = commands.add_parser(
        "tree", help="vLLM's module tree of a config, without weights or an engine"
    )
    tree.add_argument("model", help="a folder with a config.json, or a tiny model name")
    tree.add_argument("--max-model-len", type=int, default=2048, metavar="N",
                      help="context length to configure (default: 2048)")
    tree.set_defaults(run=tree_command)

    lens = commands.add_parser("lens", help="logit lens of a prompt, as a table (and a plot)")
    lens.add_argument("model", nargs="?", help="checkpoint folder (default: embedded SmolLM2)")
    lens.add_argument("prompt", nargs="?", default=DEFAULT_PROMPT)
    lens.add_argument("--plot", type=Path, metavar="FILE", help="also write a PNG heatmap here")
    lens.set_defaults(run=lens_command)

    cache = commands.add_parser(
        "cache",
        help="store activations of a prompt file, one row per token, as safetensors shards",
        usage="%(prog)s MODEL --prompts FILE --names PATTERN [PATTERN ...] --out DIR [options]\n"
              "       %(prog)s --verify DIR",
    )
    cache.add_argument("model", nargs="?", help="checkpoint folder or tiny model name")
    cache.add_argument("--prompts", type=Path, metavar="FILE",
                       help='one text per line, or .jsonl with a "text" or "tokens" field per line')
    cache.add_argument("--names", nargs="+", metavar="PATTERN",
                       help="hook names or globs, e.g. 'blocks.*.hook_resid_post'")
    cache.add_argument("--out", type=Path, metavar="DIR",
                       help="store folder; an interrupted run there resumes, and rewrites the "
                       "shards that fail their check")
    cache.add_argument("--batch-size", type=int, default=32, metavar="N",
                       help="prompts per vLLM call (default: 32)")
    cache.add_argument("--shard-tokens", type=int, default=65536, metavar="N",
                       help="rows per shard at most, unless one prompt is longer (default: 65536)")
    cache.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                       help="the engine's and the stored floats' dtype (default: float32)")
    cache.add_argument("--max-new-tokens", type=int, default=0, metavar="N",
                       help="also store N-1 greedily generated positions per prompt (default: 0)")
    cache.add_argument("--format", choices=["vlens", "saelens"], default="vlens",
                       help="saelens: also write SAELens's cached-activations dataset (a "
                       "datasets.Dataset, one row per prompt) to DIR/saelens (default: vlens, "
                       "the store alone)")
    cache.add_argument("--context-size", type=int, metavar="N",
                       help="with --format saelens: cut every prompt to its first N tokens "
                       "(default: the prompts' length, which must then be the same for all)")
    ray = cache.add_argument_group(
        "on Ray", "a store cut into blocks of prompts, filled by engines that Ray Data schedules "
        "(docs/activation-store.md)")
    ray.add_argument("--ray", nargs="?", const="", metavar="ADDRESS",
                     help="run on Ray: alone, a Ray started on this machine (or RAY_ADDRESS's); "
                     "'auto' or an address, a running cluster")
    ray.add_argument("--workers", type=int, metavar="N",
                     help="engines (default: as many as the cluster's GPUs hold, one without GPUs)")
    ray.add_argument("--gpus-per-worker", type=float, metavar="G",
                     help="default: the tensor parallel size where the cluster has GPUs, else 0")
    ray.add_argument("--cpus-per-worker", type=float, metavar="C",
                     help="default: 1 (a fraction is fine: Ray Data needs CPUs of its own)")
    ray.add_argument("--tensor-parallel-size", type=int, metavar="N",
                     help="GPUs that one worker's engine spans (default: 1)")
    ray.add_argument("--block-prompts", type=int, metavar="N",
                     help="prompts per block, the unit of work a lost worker costs (default: 1024)")
    cache.add_argument("--verify", type=Path, metavar="DIR",
                       help="only check the store in DIR (each shard's size and sha256) and "
                       "report; exit 1 when a shard fails its check")
    cache.set_defaults(run=cache_command, usage_error=cache.error)

    commands.add_parser(
        "serve", add_help=False,
        help="vLLM's OpenAI-compatible server with per-request steering and activations "
        "(vlens serve MODEL [vlens options] [vllm serve options]; --help lists them)",
    )

    parity = commands.add_parser(
        "parity", help="parity tables against HuggingFace and TransformerLens"
    )
    parity.add_argument("models", nargs="*", help="checkpoint folders or tiny model names "
                        "(default: every tiny model)")
    parity.add_argument("--out", type=Path, metavar="FILE", help="also write the report here")
    parity.set_defaults(run=parity_command)
    return root


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:  # vLLM's own option parser, with vlens's options
        from vlens.serve.server import main as serve

        return serve(argv[1:])
    commands = parser()
    args = commands.parse_args(argv)
    # A command's output is its table: vLLM's start-up warnings would bury it.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    warnings.filterwarnings("ignore", category=FutureWarning)
    if args.command is None:
        args = commands.parse_args(["lens"])
    try:
        return args.run(args) or 0
    except (StoreError, UnknownHookName) as error:  # what the user asked for: one line, no trace
        raise SystemExit(f"vlens {args.command}: {error}") from None


if __name__ == "__main__":
    sys.exit(main())
