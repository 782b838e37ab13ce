"""Tiny random checkpoints for tests: built offline, deterministic, cached on disk.

``tiny_model("qwen3")`` returns a folder that both HuggingFace transformers and vLLM (CPU) load:
``config.json``, ``model.safetensors`` (fp32), ``generation_config.json`` and a byte-level BPE
tokenizer trained in-process, so tests never touch the network and run in seconds.

``tiny_model(arch, init_std=0.02)`` is the same recipe drawn with another init standard deviation,
in its own folder, so the default checkpoints never change.

Each mapping file declares its architecture's tiny checkpoints
(``ArchitectureMapping.tiny_configs``: a name and the function building its transformers config,
from the sizes in ``mappings/_tiny.py``); ``ARCHS`` and ``CONFIG_BUILDERS`` are read from
them. This module deliberately does not import vLLM, so that importing it
stays cheap.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedTokenizerFast,
)

from vlens.mappings._tiny import (
    INIT_STD,
    MAX_POSITIONS,
    VOCAB_SIZE,
)

# Bump when the recipe changes, so that stale cached checkpoints are never reused.
_RECIPE_VERSION = "v1"

BOS_TOKEN, EOS_TOKEN = "<|bos|>", "<|eos|>"

# Norm weights start at 1 and biases at 0; jittering them makes a mapping that forgets a norm
# weight, a bias or the router's correction bias visibly wrong instead of accidentally right.
CONSTANT_JITTER_STD = 0.1

_TRAINING_TEXT = """\
The river ran past the old mill, and every morning the miller opened the gates to let the water
turn the great wheel. Children walked along the bank on their way to school, counting the ducks
and throwing small stones that skipped three or four times before they sank. In the afternoon
the light changed: the water became brown and gold, and the shadows of the trees stretched
across the path. Nobody in the village could remember when the mill was built, but everyone
agreed that it was older than the church and probably older than the bridge.

A computer is a machine that follows instructions. It reads numbers from memory, adds or
multiplies them, compares the results and writes new numbers back. Everything else, from
playing music to drawing pictures or translating a sentence into another language, is built
from these simple steps repeated billions of times each second. Programmers describe the steps
in a language that people can read, and a compiler turns that description into the codes the
processor understands.

Hello world, this is a short test. What is the capital of France? Paris is the capital of
France, and Berlin is the capital of Germany. The quick brown fox jumps over the lazy dog.
She said that she would arrive on Monday, but the train was late and she did not come until
Wednesday evening. They were happy to see her anyway, and they cooked a large dinner with bread,
cheese, soup, apples and a cake with seven candles.

Scientists study the world by asking questions and testing their answers. A good experiment
changes one thing at a time and measures what happens. When the results surprise us, we learn
the most: either the measurement was wrong, or our idea about the world needs to change. Over
many years, careful observation has explained the motion of planets, the growth of plants, the
spread of disease and the behaviour of light.

In winter the roads were covered with snow, and the farmers stayed inside to repair their tools.
They talked about the weather, the price of wheat, their neighbours and their plans for spring.
When the snow melted, the fields turned green again, the birds returned from the south, and the
whole valley seemed to wake up from a long sleep. 0123456789 + - * / = ( ) [ ] { } < > ! ? . , ;
"""


def tiny_configs() -> dict[str, Callable[[], PretrainedConfig]]:
    """Every tiny checkpoint's name → the function building its config, as the mapping files
    declare them (``ArchitectureMapping.tiny_configs``); a name two files declare is an error."""
    from vlens.mappings import mapping_modules

    builders: dict[str, Callable[[], PretrainedConfig]] = {}
    owners: dict[str, str] = {}
    for module, mapping in mapping_modules().items():
        for name, build in mapping.tiny_configs.items():
            if name in builders:
                raise ValueError(
                    f"tiny model {name!r} is declared by mappings/{owners[name]}.py and "
                    f"mappings/{module}.py: give one of them another name"
                )
            builders[name], owners[name] = build, module
    return builders


def tiny_mapping(arch: str) -> Any:
    """The :class:`~vlens.names.mapping.ArchitectureMapping` that declares tiny model ``arch``."""
    from vlens.mappings import mapping_modules

    for mapping in mapping_modules().values():
        if arch in mapping.tiny_configs:
            return mapping
    raise ValueError(f"unknown arch {arch!r}; choose from {tuple(tiny_configs())}")


def tiny_archs(where: Callable[[Any], bool] = lambda mapping: True) -> tuple[str, ...]:
    """The tiny models whose mapping satisfies ``where`` (e.g. ``lambda m: m.compiled_graph``)."""
    return tuple(arch for arch in tiny_configs() if where(tiny_mapping(arch)))


#: Set to 1, the suite's per-architecture sweeps run over every architecture they apply to
#: (:func:`sweep`); unset, over the architectures each sweep names, one per mechanism.
EVERY_ARCH = "VLENS_TEST_EVERY_ARCH"


def sweep(every: tuple[str, ...], chosen: Mapping[str, str]) -> tuple[str, ...]:
    """The tiny models of a per-architecture sweep: ``every`` under ``VLENS_TEST_EVERY_ARCH=1``,
    else ``chosen`` (architecture → the mechanism it stands for), each of them one of ``every``.
    A sweep builds an engine of its own per architecture, which is what makes the whole of it
    too slow for every run."""
    missing = [arch for arch in chosen if arch not in every]
    if missing:
        raise ValueError(f"{missing} are not in this sweep; choose from {every}")
    return every if os.environ.get(EVERY_ARCH) == "1" else tuple(chosen)


def __getattr__(name: str) -> Any:
    """``CONFIG_BUILDERS`` (:func:`tiny_configs`) and ``ARCHS`` (its names), read from the
    mapping files on each access (never at import: mapping files import this module)."""
    if name == "CONFIG_BUILDERS":
        return tiny_configs()
    if name == "ARCHS":
        return tuple(tiny_configs())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on the embedded text: any string tokenizes, with no download."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[BOS_TOKEN, EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_TRAINING_TEXT.splitlines(keepends=True), trainer=trainer)
    assert tokenizer.get_vocab_size() == VOCAB_SIZE, "embedded text too short for the vocab"
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        model_max_length=MAX_POSITIONS,
    )


@torch.no_grad()
def _jitter_constant_tensors(model: torch.nn.Module) -> None:
    """Add noise to every tensor that initialization left constant (norm weights, biases...)."""
    for tensor in model.state_dict().values():
        constant = tensor.numel() > 1 and bool((tensor == tensor.flatten()[0]).all())
        if tensor.is_floating_point() and constant:
            tensor.add_(torch.randn(tensor.shape, dtype=tensor.dtype) * CONSTANT_JITTER_STD)


def build_checkpoint(arch: str, seed: int, folder: Path, init_std: float = INIT_STD) -> None:
    """Write a random fp32 checkpoint for ``arch`` and the tokenizer into ``folder``; weights
    are drawn with standard deviation ``init_std`` (recorded as ``initializer_range``)."""
    config = tiny_configs()[arch]()
    config.initializer_range = init_std
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _jitter_constant_tensors(model)
    model.save_pretrained(folder)
    save_tokenizer(folder)


def save_tokenizer(folder: Path) -> None:
    """:func:`build_tokenizer` into ``folder`` (which holds the model's config). Where
    transformers loads it with the model type's own class instead (Qwen2's), that class adds its
    default special tokens past this vocabulary (``<|endoftext|>`` as unknown and padding
    token): the tokenizer is then saved with EOS as both, so that every id is an embedding row."""
    build_tokenizer().save_pretrained(folder)
    if len(AutoTokenizer.from_pretrained(folder)) > VOCAB_SIZE:
        tokenizer = build_tokenizer()
        tokenizer.pad_token = tokenizer.unk_token = EOS_TOKEN
        tokenizer.save_pretrained(folder)


def _build_atomically(target: Path, build: Callable[[Path], None]) -> None:
    """Build into a temporary sibling, then rename it into place.

    Readers never see a half-written folder; if another process finished first, its folder is
    kept and ours discarded.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        build(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared
        os.rename(tmp, target)
    except OSError:
        if not target.is_dir():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def cache_root() -> Path:
    """Where tiny checkpoints live: ``$VLENS_CACHE`` or ``~/.cache/vlens``."""
    return Path(os.environ.get("VLENS_CACHE", Path.home() / ".cache" / "vlens"))


def init_tag(init_std: float | None) -> str:
    """The folder-name suffix of a checkpoint drawn with ``init_std``: empty for the default
    (``None`` or ``INIT_STD``), so that the default folders keep their names, else ``-std0.02``."""
    if init_std is None or init_std == INIT_STD:
        return ""
    if not init_std > 0:
        raise ValueError(f"init_std must be positive, got {init_std!r}")
    return f"-std{init_std:g}"


def tiny_model(arch: str, seed: int = 0, init_std: float | None = None) -> Path:
    """Return the folder of a tiny random ``arch`` checkpoint, building it on first use.

    ``arch`` is one of ``ARCHS``, the names the mapping files declare ("llama", "qwen3",
    "gpt2", "deepseek_v3", "deepseek_v2", ...).
    ``init_std`` replaces ``INIT_STD`` as the weights' standard deviation; such a variant gets its
    own folder (``{arch}-seed{seed}-std{init_std}-v1``, e.g. ``qwen3-seed0-std0.02-v1``).
    The same ``arch``, ``seed`` and ``init_std`` always give bit-identical weights.
    """
    builders = tiny_configs()
    if arch not in builders:
        raise ValueError(f"unknown arch {arch!r}; choose from {tuple(builders)}")
    tag = init_tag(init_std)
    std = INIT_STD if init_std is None else init_std
    target = cache_root() / "tiny" / f"{arch}-seed{seed}{tag}-{_RECIPE_VERSION}"
    if not target.is_dir():
        _build_atomically(target, lambda folder: build_checkpoint(arch, seed, folder, std))
    return target
