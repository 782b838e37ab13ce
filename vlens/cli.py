"""The ``vlens`` command. With no arguments it shows the logit lens of the embedded default model
(SmolLM2-135M-Instruct) on "The capital of France is"."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

DEFAULT_PROMPT = "The capital of France is"


def model_folder(name: str | None) -> Path:
    """A checkpoint folder, a tiny test model's name, or (None) the embedded SmolLM2."""
    if name is None:
        from vlens.embedded import smollm2_path

        return smollm2_path()
    from vlens.testing import CONFIG_BUILDERS, tiny_model

    if name in CONFIG_BUILDERS:
        return tiny_model(name)
    if not Path(name).is_dir():
        raise SystemExit(f"vlens: {name!r} is neither a checkpoint folder nor a tiny model name")
    return Path(name)


def names_command(args: argparse.Namespace) -> None:
    from transformers import AutoConfig

    from vlens.mappings import mapping_for

    config = AutoConfig.from_pretrained(model_folder(args.model))
    for name, spec in mapping_for(config).expanded(config).items():
        print(f"{name:45} [batch {spec.shape}]")


def lens_command(args: argparse.Namespace) -> None:
    from vlens import HookedVLLM
    from vlens.lens import format_lens, logit_lens
    from vlens.weights import CheckpointWeights

    folder = model_folder(args.model)
    model = HookedVLLM.from_pretrained(folder, dtype="float32", max_model_len=1024)
    view = logit_lens(model, args.prompt, CheckpointWeights(folder))
    print(f"Logit lens of {args.prompt!r}: the top next token at each layer (rows) and position")
    print(format_lens(view))
    print(f"\nThe model's prediction after the last token: {view.top_tokens[-1][-1]!r}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="vlens", description=__doc__)
    commands = parser.add_subparsers(dest="command")
    names = commands.add_parser("names", help="list a model's hook names with their shapes")
    names.add_argument("model", nargs="?", help="checkpoint folder or tiny model name")
    names.set_defaults(run=names_command)
    lens = commands.add_parser("lens", help="logit lens of a prompt, as a table")
    lens.add_argument("model", nargs="?", help="checkpoint folder (default: embedded SmolLM2)")
    lens.add_argument("prompt", nargs="?", default=DEFAULT_PROMPT)
    lens.set_defaults(run=lens_command)
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if args.command is None:
        args = parser.parse_args(["lens"])
    args.run(args)


if __name__ == "__main__":
    sys.exit(main())
