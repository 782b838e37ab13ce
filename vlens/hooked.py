"""``HookedVLLM``: TransformerLens's ``HookedTransformer`` habits on a vLLM engine."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from einops import rearrange
from jaxtyping import Float, Int
from torch import Tensor
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from vlens.cache import VLensCache, join_chunks, pad_batch
from vlens.derived import Batch
from vlens.engine import Engine
from vlens.mapping import DerivedSpec, HookSpec, Spec
from vlens.mappings import mapping_for
from vlens.names import NamesFilter, select_names
from vlens.runtime.layout import TAG_KEY
from vlens.runtime.worker import RequestCapture
from vlens.weights import CheckpointWeights

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
        path: Path,
        config: PretrainedConfig,
        tokenizer: PreTrainedTokenizerBase,
        hook_specs: dict[str, Spec],
    ) -> None:
        self.engine = engine
        self.weights = CheckpointWeights(path)
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
        return cls(Engine(str(path), **engine_kwargs), Path(path), config, tokenizer, hook_specs)

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
        max_new_tokens: int = 0,
    ) -> tuple[Float[Tensor, "batch pos d_vocab"] | None, VLensCache]:
        """Run the prompts through vLLM and return ``(logits, cache)``.

        Logits are at every position; prompts of different lengths are right-padded with zeros,
        and ``cache.lengths`` / ``cache.attention_mask`` tell real positions from padding.

        With ``max_new_tokens=n`` each prompt is also continued greedily by ``n`` tokens and the
        cache covers the decode steps too: positions ``prompt + n - 1`` (the last sampled token
        is never run through the model). ``cache.tokens`` holds the token at every position.
        """
        if return_type not in ("logits", None):
            raise ValueError(f"return_type must be 'logits' or None, not {return_type!r}")
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, not {max_new_tokens}")
        prompts = self.token_lists(input)
        names = select_names(names_filter, self.hook_names)
        wanted = names + ([LOGITS] if return_type == "logits" and LOGITS not in names else [])
        site_specs = {name: self.hook_specs[name] for name in self._site_names(wanted)}
        captures, generated = self._capture(prompts, site_specs, max_new_tokens)
        tokens = [p + g[: max(0, len(g) - 1)] for p, g in zip(prompts, generated)]
        lengths = torch.tensor([len(t) for t in tokens])
        values = {
            name: self._padded(name, spec, captures, lengths) for name, spec in site_specs.items()
        }
        batch = Batch(mask=torch.arange(int(lengths.max()))[None] < lengths[:, None], weights=self.weights)
        for name in wanted:
            self._derive(name, values, batch)
        shapes = {name: self.hook_specs[name].shape for name in names}
        cache = VLensCache({name: values[name] for name in names}, self, lengths, shapes)
        cache.tokens = pad_batch([torch.tensor(t) for t in tokens])
        return (values[LOGITS] if return_type == "logits" else None), cache

    def _site_names(self, names: list[str]) -> list[str]:
        """The names read from vLLM sites that ``names`` need (derived names' sources included)."""
        needed: dict[str, None] = {}
        pending = list(names)
        while pending:
            name = pending.pop()
            spec = self.hook_specs[name]
            if isinstance(spec, DerivedSpec):
                pending.extend(spec.sources)
            else:
                needed[name] = None
        return [name for name in self.hook_specs if name in needed]

    @staticmethod
    def _padded(
        name: str, spec: HookSpec, captures: list[RequestCapture], lengths: Tensor
    ) -> Tensor:
        rows = [join_chunks(name, c.chunks[name], int(n)) for c, n in zip(captures, lengths)]
        value = pad_batch(rows)
        return value if spec.arrange is None else rearrange(value, spec.arrange)

    def _derive(self, name: str, values: dict[str, Tensor], batch: Batch) -> Tensor:
        if name not in values:
            spec = self.hook_specs[name]
            assert isinstance(spec, DerivedSpec)
            sources = [self._derive(source, values, batch) for source in spec.sources]
            values[name] = spec.compute(sources, batch)
        return values[name]

    def _capture(
        self, prompts: list[list[int]], specs: dict[str, HookSpec], max_new_tokens: int
    ) -> tuple[list[RequestCapture], list[list[int]]]:
        """Greedy generation over ``prompts`` (one token, discarded, when ``max_new_tokens`` is 0)
        with ``specs`` captured; returns the captures and the generated tokens kept."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        call = next(_call_ids)
        tags = [f"{call}:{index}" for index in range(len(prompts))]
        self.engine.on_workers("prepare", {tag: specs for tag in tags})
        try:
            outputs = self.engine.llm.generate(
                [TokensPrompt(prompt_token_ids=prompt) for prompt in prompts],
                [
                    SamplingParams(
                        max_tokens=max(1, max_new_tokens),
                        temperature=0.0,
                        extra_args={TAG_KEY: tag},
                    )
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
        generated = [list(out.outputs[0].token_ids) if max_new_tokens else [] for out in outputs]
        return captures, generated
