"""``vlens serve MODEL [vlens options] [vllm serve options]``: vLLM's own OpenAI-compatible server
(its app, AsyncLLM and engine process) with vlens's worker runtime in the engine, its engine
client around vLLM's (:mod:`vlens.serve.engine_client`) and its routes (:mod:`vlens.serve.routes`).

Every ``vllm serve`` option keeps its meaning, with vlens's defaults: the server binds 127.0.0.1
unless ``--host`` says otherwise, each request uses the prefix cache as far as it is correct for
it (:mod:`vlens.engine.prefix_cache`), and the engine runs eager unless names are declared for
the compiled engine with ``--compiled-capture`` / ``--compiled-steering``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import Tensor

from vlens.engine.arguments import architecture_args, prepare_engine
from vlens.engine.process_state import FOREIGN_PLUGINS, plugins_except
from vlens.runtime.compiled.workers import graph_names_for_workers, with_graph_args
from vlens.serve.captures import HeldCaptures
from vlens.serve.engine_client import VlensEngineClient
from vlens.serve.fields import read_fields
from vlens.serve.model import ServedModel
from vlens.serve.routes import SERVING, VlensRoutes
from vlens.serve.vllm_server import server_functions

#: The bound of the captures a server holds unless ``--capture-bytes`` is given.
DEFAULT_CAPTURE_BYTES = 2**30


def parser() -> argparse.ArgumentParser:
    """vLLM's ``serve`` parser, with vlens's options and defaults."""
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    serve = server_functions().make_arg_parser(FlexibleArgumentParser(
        prog="vlens serve",
        description="vLLM's OpenAI-compatible server with per-request steering and activations "
        "in TransformerLens's hook names (a `vlens` object in the request body).",
    ))
    group = serve.add_argument_group("vlens")
    group.add_argument("--vectors", type=Path, metavar="FILE",
                       help="a .safetensors file of named vectors that requests may steer with "
                       "by name")
    group.add_argument("--capture-bytes", "--activation-store-bytes", type=int,
                       default=DEFAULT_CAPTURE_BYTES, dest="capture_bytes", metavar="N",
                       help="captured activations held until fetched, at most this many bytes; "
                       "the least recently held go first (default: 1 GiB)")
    group.add_argument("--steered-model", action="append", default=[], metavar="NAME=FILE",
                       help="serve the model also as NAME, steered as the `vlens` object in the "
                       "JSON FILE says for every request to NAME (for clients such as lm-eval, "
                       "which cannot add fields to a request); repeatable")
    group.add_argument("--compiled-capture", nargs="+", default=[], metavar="NAME",
                       help="run vLLM's compiled graph with these names traced in, for capture")
    group.add_argument("--compiled-steering", nargs="+", default=[], metavar="NAME",
                       help="run vLLM's compiled graph with these names steerable")
    group.add_argument("--sae", action="append", default=[], metavar="NAME=DIR",
                       help="put the SAE that SAELens saved in DIR into vLLM's compiled graph as "
                       "NAME: requests edit its features (steering entries with \"sae\": NAME) "
                       "and, with --sae-top-k, capture its top-k features; repeatable")
    group.add_argument("--sae-top-k", type=int, default=None, metavar="K",
                       help="each --sae's K largest features per position are names to capture "
                       "({hook_name}.hook_sae_acts_post.top_k_values and .top_k_indices)")
    group.add_argument("--sae-slots", type=int, default=1024, metavar="N",
                       help="distinct features of one SAE that the requests being served may "
                       "edit at once (default: 1024)")
    serve.set_defaults(host="127.0.0.1")
    return serve


def explicit_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, Any]:
    """The options given on the command line (those whose value is not the parser's default)."""
    return {key: value for key, value in vars(args).items() if value != parser.get_default(key)}


def read_saes(specs: list[str]) -> dict[str, Path]:
    """``--sae NAME=DIR`` options, by name."""
    saes: dict[str, Path] = {}
    for spec in specs:
        name, sep, folder = spec.partition("=")
        if not sep or not name or not folder:
            raise ValueError(f"--sae {spec!r}: give NAME=DIR (the folder SAELens saved the SAE in)")
        if name in saes:
            raise ValueError(f"--sae: {name!r} is given twice")
        saes[name] = Path(folder)
    return saes


def read_vectors(path: Path | None) -> dict[str, Tensor]:
    """The named vectors of ``--vectors`` (as float32)."""
    if path is None:
        return {}
    if not path.is_file():
        raise SystemExit(f"vlens serve: --vectors {path}: no such file")
    return {name: value.to(torch.float32) for name, value in load_file(str(path)).items()}


def read_steered_models(specs: list[str], vectors: dict[str, Tensor]) -> dict[str, dict]:
    """``--steered-model NAME=FILE``: each name's ``vlens`` object, checked as a request's is."""
    models: dict[str, dict] = {}
    for spec in specs:
        name, _, file = spec.partition("=")
        if not name or not file:
            raise SystemExit(f"vlens serve: --steered-model {spec!r}: expected NAME=FILE.json")
        try:
            value = json.loads(Path(file).read_text())
            read_fields(value, vectors)
        except (OSError, ValueError) as error:
            raise SystemExit(f"vlens serve: --steered-model {spec}: {error}") from None
        models[name] = value
    return models


def main(argv: list[str]) -> int:
    import uvloop
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup

    vllm = server_functions()

    cli_env_setup()
    options = parser()
    args = options.parse_args(argv)
    if args.model_tag is not None:  # vLLM's positional MODEL
        args.model = args.model_tag
    compiled = bool(args.compiled_capture or args.compiled_steering or args.sae)
    vllm.validate_parsed_serve_args(args)
    if (getattr(args, "api_server_count", None) or 1) > 1:
        raise SystemExit(
            "vlens serve: --api-server-count above 1 is not supported: captures wait in the "
            "API process that served their request"
        )
    if not Path(args.model).is_dir():
        raise SystemExit(
            f"vlens serve: {args.model!r} is not a checkpoint folder (vlens reads the model's "
            "config, tokenizer and weights from one)"
        )
    try:  # what the user can fix, said in one line before anything starts
        user_args = explicit_options(options, args)
        saes = read_saes(args.sae)
        served = ServedModel(args.model, args.compiled_capture, args.compiled_steering, user_args,
                             saes, args.sae_slots, args.sae_top_k)
        user_args = {**architecture_args(served.checkpoint.mapping), **user_args}
        engine = prepare_engine(user_args, compiled)
        for key, value in engine.items():  # as vLLM's serve options
            setattr(args, key, value)
        captures = HeldCaptures(args.capture_bytes)
        vectors = read_vectors(args.vectors)
        steered_models = read_steered_models(args.steered_model, vectors)
        for steered in steered_models:
            served.plan(read_fields(steered_models[steered], vectors))
    except (OSError, ValueError, KeyError, NotImplementedError) as error:
        raise SystemExit(f"vlens serve: {error}") from None
    names = list(args.served_model_name or [args.model])
    args.served_model_name = names + [name for name in steered_models if name not in names]

    async def serve() -> None:
        """vLLM's single-process server, its engine client wrapped in vlens's."""
        listen_address, sock = vllm.setup_server(args, reuse_port=False)
        try:
            async with vllm.build_async_engine_client(args) as engine:
                SERVING.client = VlensEngineClient(engine, served, vectors, captures, steered_models)
                shutdown = await vllm.build_and_serve(SERVING.client, listen_address, sock, args)
            await shutdown
        finally:
            sock.close()

    with graph_names_for_workers(served.checkpoint.graph_names) as graph_args, plugins_except(
        FOREIGN_PLUGINS, endpoints=frozenset({VlensRoutes.name})
    ):
        if "worker_cls" in graph_args:
            args.worker_cls = graph_args["worker_cls"]
        if "additional_config" in graph_args:
            own = {"additional_config": getattr(args, "additional_config", None)}
            args.additional_config = with_graph_args(own, graph_args)["additional_config"]
        uvloop.run(serve())
    return 0
