"""``HookedVLLM``: TransformerLens's ``HookedTransformer`` habits on a vLLM engine."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from jaxtyping import Float, Int
from torch import Tensor
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from vlens.cache import VLensCache, join_chunks, pad_batch
from vlens.engine import Engine
from vlens.mapping import HookSpec
from vlens.mappings import mapping_for
from vlens.names import NamesFilter, select_names
from vlens.runtime.layout import TAG_KEY
from vlens.runtime.worker import RequestCapture

Input = str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]] | Tensor
LOGITS = "unembed.hook_out"
_call_ids = itertools.count()


@dataclass(frozen=True)
class ModelConfig:
    """The model's dimensions under TransformerLens's names (``model.cfg``)."""

    n_layers: int
    d_model: int
    n_heads: int
    n_key_value_heads: int
    d_head: int
    d_mlp: int
    d_vocab: int
    n_ctx: int
    architecture: str

    @classmethod
    def from_hf(cls, config: PretrainedConfig) -> ModelConfig:
        n_heads = config.num_attention_heads
        return cls(
            n_layers=config.num_hidden_layers,
            d_model=config.hidden_size,
            n_heads=n_heads,
            n_key_value_heads=getattr(config, "num_key_value_heads", None) or n_heads,
            d_head=getattr(config, "head_dim", None) or config.hidden_size // n_heads,
            d_mlp=getattr(config, "intermediate_size", None) or 4 * config.hidden_size,
            d_vocab=config.vocab_size,
            n_ctx=config.max_position_embeddings,
            architecture=config.architectures[0],
        )


class HookedVLLM:
    """A vLLM engine that answers in TransformerLens hook names.

    Build it with :meth:`from_pretrained`; ``print(model)`` shows vLLM's module tree;
    :attr:`hook_names` lists every name this architecture offers.
    """

    def __init__(
        self,
        engine: Engine,
        config: PretrainedConfig,
        tokenizer: PreTrainedTokenizerBase,
        hook_specs: dict[str, HookSpec],
    ) -> None:
        self.engine = engine
        self.hf_config = config
        self.cfg = ModelConfig.from_hf(config)
        self.tokenizer = tokenizer
        self.hook_specs = hook_specs

    @classmethod
    def from_pretrained(cls, path: str | Path, **engine_kwargs: Any) -> HookedVLLM:
        """Load a local HuggingFace checkpoint into vLLM; ``engine_kwargs`` go to ``vllm.LLM``
        (``dtype``, ``max_model_len``, ...). vlens turns on eager mode and turns off prefix caching.
        """
        config = AutoConfig.from_pretrained(path)
        hook_specs = mapping_for(config).expanded(config)
        tokenizer = AutoTokenizer.from_pretrained(path)
        return cls(Engine(str(path), **engine_kwargs), config, tokenizer, hook_specs)

    @property
    def hook_names(self) -> list[str]:
        """Every canonical hook name of this model, in forward order."""
        return list(self.hook_specs)

    def __repr__(self) -> str:
        return self.engine.on_driver("module_tree")

    # ---- tokens ------------------------------------------------------------------------------

    def token_lists(self, input: Input) -> list[list[int]]:
        """Each prompt of ``input`` as token ids: strings go through the checkpoint's tokenizer
        with its own special-token rule (the same ids HuggingFace would use)."""
        if isinstance(input, Tensor):
            rows = input.tolist() if input.dim() == 2 else [input.tolist()]
        elif isinstance(input, str):
            rows = [self.tokenizer(input)["input_ids"]]
        elif len(input) == 0:
            raise ValueError("input is empty: give a string, a list of strings or token ids")
        elif all(isinstance(item, str) for item in input):
            rows = [self.tokenizer(text)["input_ids"] for text in input]
        elif all(isinstance(item, int) for item in input):
            rows = [list(input)]
        else:
            rows = [list(map(int, row)) for row in input]
        for index, row in enumerate(rows):
            if not row:
                raise ValueError(f"prompt {index} has no tokens")
            if max(row) >= self.cfg.d_vocab or min(row) < 0:
                raise ValueError(f"prompt {index} has a token id outside [0, {self.cfg.d_vocab})")
        return rows

    def to_tokens(self, input: Input) -> Int[Tensor, "batch pos"]:
        """Token ids as ``[batch, pos]``, right-padded with the pad (or eos) token."""
        rows = self.token_lists(input)
        pad = self.tokenizer.pad_token_id
        pad = self.tokenizer.eos_token_id if pad is None else pad
        longest = max(len(row) for row in rows)
        return torch.tensor([row + [pad or 0] * (longest - len(row)) for row in rows])

    def to_string(self, tokens: Sequence[int] | Tensor) -> str:
        ids = tokens.tolist() if isinstance(tokens, Tensor) else list(tokens)
        return self.tokenizer.decode(ids)

    # ---- caching -----------------------------------------------------------------------------

    def run_with_cache(
        self,
        input: Input,
        names_filter: NamesFilter = None,
        return_type: Literal["logits"] | None = "logits",
    ) -> tuple[Float[Tensor, "batch pos d_vocab"] | None, VLensCache]:
        """Run the prompts through vLLM and return ``(logits, cache)``.

        Logits are at every prompt position; prompts of different lengths are right-padded with
        zeros, and ``cache.lengths`` / ``cache.attention_mask`` tell real positions from padding.
        """
        if return_type not in ("logits", None):
            raise ValueError(f"return_type must be 'logits' or None, not {return_type!r}")
        prompts = self.token_lists(input)
        names = select_names(names_filter, self.hook_names)
        wanted = set(names) | ({LOGITS} if return_type == "logits" else set())
        captures = self._capture(prompts, {name: self.hook_specs[name] for name in wanted})
        lengths = [len(prompt) for prompt in prompts]
        joined = {
            name: pad_batch([join_chunks(name, c.chunks[name], n) for c, n in zip(captures, lengths)])
            for name in wanted
        }
        cache = VLensCache({name: joined[name] for name in names}, self, torch.tensor(lengths))
        return (joined[LOGITS] if return_type == "logits" else None), cache

    def _capture(
        self, prompts: list[list[int]], specs: dict[str, HookSpec]
    ) -> list[RequestCapture]:
        """One forward over each prompt (one sampled token, discarded) with ``specs`` captured."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        call = next(_call_ids)
        tags = [f"{call}:{index}" for index in range(len(prompts))]
        self.engine.on_workers("prepare", {tag: specs for tag in tags})
        try:
            self.engine.llm.generate(
                [TokensPrompt(prompt_token_ids=prompt) for prompt in prompts],
                [
                    SamplingParams(max_tokens=1, temperature=0.0, extra_args={TAG_KEY: tag})
                    for tag in tags
                ],
                use_tqdm=False,
            )
        finally:
            captured = self.engine.on_driver("finish", tags)
        captures = [captured[tag] for tag in tags]
        for index, capture in enumerate(captures):
            if capture.error is not None:
                raise RuntimeError(f"prompt {index}: {capture.error}")
        return captures
