"""``HookedVLLM``: TransformerLens's ``HookedTransformer`` habits on a vLLM engine."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

import torch
from einops import rearrange
from jaxtyping import Float, Int
from torch import Tensor
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from vlens.analysis import AnalysisWeights, WeightViews
from vlens.cache import VLensCache, pad_batch, padded_batch
from vlens.compiled import (
    EAGER,
    CompiledNames,
    check_steerable,
    declare,
    per_position_shape,
)
from vlens.derived import Batch, SampledTokens, WeightsOn
from vlens.engine import Engine
from vlens.hook_registry import FwdHooks, HookRegistry, NameOrFilter
from vlens.mapping import ArchitectureMapping, DerivedSpec, HookSpec, Site, Spec
from vlens.mappings import mapping_for
from vlens.model_config import ModelConfig
from vlens.names import NamesFilter, select_names
from vlens.raw import RAW_NAME, prefill_only, raw_spec
from vlens.readers import OutputOf
from vlens.runtime.hooks import HookError
from vlens.runtime.layout import TAG_KEY
from vlens.runtime.plan import HookFunction, NamePlan, RequestPlan
from vlens.runtime.probe import ModuleRecord
from vlens.runtime.step_store import PaddedRows
from vlens.runtime.worker import RequestCapture
from vlens.steering import Steer, as_hook_function, steers_by_name
from vlens.weights import CheckpointWeights

Input = str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]] | Tensor
LOGITS = "unembed.hook_out"

#: Engine-level names, the same for every architecture, one row per sampled token: each step's
#: logits for the token a request samples next, as the sampler receives them (editable: a hook
#: can ban or boost tokens for one request), and the token it sampled (read-only).
SAMPLER_NAMES: dict[str, Spec] = {
    "sampler.hook_logits": HookSpec(Site("logits_processor", "sampled"), OutputOf(), "new_pos d_vocab"),
    "sampler.hook_tokens": DerivedSpec((), SampledTokens(), "new_pos"),
}
_call_ids = itertools.count()


@dataclass(frozen=True)
class Generation:
    """One finished request of :meth:`HookedVLLM.generate`."""

    prompt_tokens: list[int]
    tokens: list[int]  # the generated ones
    text: str  # the generated text
    finish_reason: str | None  # "length", "stop", ...


class HookedVLLM(WeightViews):
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
        mapping: ArchitectureMapping,
        compiled: CompiledNames | None = None,
    ) -> None:
        self.engine = engine
        self.weights = CheckpointWeights(path)
        self.hf_config = config
        self.compiled = compiled
        self.hook_specs: dict[str, Spec] = all_specs(mapping, config)
        self.canonical_names = list(self.hook_specs)
        self.cfg = ModelConfig.from_hf(config, mapping, list(self.hook_specs))
        self.tokenizer = tokenizer
        self.explain = mapping.unavailable
        self.registry = HookRegistry(self.hook_specs, self.explain)
        self.analysis = AnalysisWeights(self.weights, mapping.weights, config, self.cfg.n_heads)

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        compiled_capture: NamesFilter | Sequence[str] = (),
        compiled_steering: NamesFilter | Sequence[str] = (),
        **engine_kwargs: Any,
    ) -> HookedVLLM:
        """Load a local HuggingFace checkpoint into vLLM; ``engine_kwargs`` go to ``vllm.LLM``
        (``dtype``, ``max_model_len``, ...). vlens turns off prefix caching.

        Without compiled names the engine runs eager: every name can be read and hooked with
        Python functions. With ``compiled_capture`` (names to read; lists or name filters) and/or
        ``compiled_steering`` (names :class:`~vlens.steering.Steer` values may change) it runs in
        vLLM's compiled mode (torch.compile, and CUDA graphs on a GPU) with those names traced
        into the graph: much faster generation, but only the declared names, and steering as
        data instead of hook functions.
        """
        config = AutoConfig.from_pretrained(path)
        mapping = mapping_for(config)
        if int(engine_kwargs.get("pipeline_parallel_size", 1)) > 1:
            raise NotImplementedError(
                "pipeline_parallel_size > 1 is not supported yet: each stage holds only its own "
                "layers, and vlens collects values from one rank; use tensor_parallel_size"
            )
        parallel = int(engine_kwargs.get("tensor_parallel_size", 1))
        if parallel > 1 and not mapping.tensor_parallel:
            raise NotImplementedError(
                f"tensor_parallel_size={parallel}: the {config.architectures[0]} mapping does not "
                f"yet mark the values vLLM splits over ranks; run it with tensor_parallel_size=1"
            )
        compiled = None
        if compiled_capture or compiled_steering:
            if not mapping.compiled_graph:
                raise NotImplementedError(
                    f"compiled names are not offered for {config.architectures[0]} yet: its "
                    f"mapping does not mark its names as verified to read the same traced into "
                    f"vLLM's graph as in eager mode (ArchitectureMapping.compiled_graph); load "
                    f"it without compiled_capture/compiled_steering (eager mode)"
                )
            specs = all_specs(mapping, config)
            compiled = declare(
                specs, config, compiled_capture, compiled_steering, mapping.unavailable
            )
        tokenizer = AutoTokenizer.from_pretrained(path)
        graph_names = compiled.graph_names if compiled else ()
        engine = Engine(str(path), graph_names, **engine_kwargs)
        return cls(engine, Path(path), config, tokenizer, mapping, compiled)

    @property
    def hook_names(self) -> list[str]:
        """Every canonical hook name of this model, in forward order."""
        return list(self.canonical_names)

    @cached_property
    def module_records(self) -> dict[str, ModuleRecord]:
        """vLLM's module tree, path by path, with what each module did in one short generation
        (a prefill and a decode step): the facts behind raw locations' errors."""
        self.engine.on_workers("start_probe")
        try:
            self._run([self.token_lists("probe")[0]], [RequestPlan(0, {})], self._greedy(2))
        finally:
            records = self.engine.on_driver("finish_probe")
        return records

    def _admit_raw(self, names: object, decoding: bool = False) -> None:
        """Make raw module locations among ``names`` (a name, or a list of names and
        ``(name, hook)`` pairs) known, checking them against the module tree."""
        if isinstance(names, str) or callable(names) or names is None:
            names = [names]
        for item in names:
            name = item[0] if isinstance(item, tuple) else item
            if not isinstance(name, str) or not RAW_NAME.fullmatch(name):
                continue
            if name.rsplit(".", 1)[0] in self.canonical_names:
                continue
            if name not in self.hook_specs:
                if self.compiled is not None:
                    raise ValueError(
                        f"{name}: raw module locations need {EAGER} (a compiled engine's "
                        f"forward is a traced graph; it runs no hooks added after loading)"
                    )
                if self.engine.tensor_parallel_size > 1:
                    raise NotImplementedError(
                        f"{name}: raw locations are not yet available under tensor parallelism "
                        f"(each rank holds its own slice of many modules' values); use canonical "
                        f"names"
                    )
                self.hook_specs[name] = raw_spec(name, self.module_records)
            spec = self.hook_specs[name]
            if decoding and prefill_only(spec.site.path, self.module_records):
                raise ValueError(
                    f"{spec.site.path} runs at prefill only (vLLM folds it into another "
                    f"kernel in decode steps): {name} has no value at generated positions"
                )

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

    # ---- hooks (TransformerLens's API) -------------------------------------------------------

    def add_hook(
        self,
        name: NameOrFilter,
        hook: HookFunction,
        dir: Literal["fwd"] = "fwd",
        is_permanent: bool = False,
    ) -> None:
        """Run ``hook(tensor, hook_point)`` at ``name`` (or every name a filter accepts) in every
        later call, until :meth:`reset_hooks`. It may return a replacement tensor, or edit the
        tensor in place and return None; either reaches the model."""
        if dir != "fwd":
            raise ValueError("vLLM runs inference only: there are no backward hooks (dir='fwd')")
        self._admit_raw(name)
        self._refuse_python_in_graph(self.registry.names(name))
        self.registry.add(name, hook, is_permanent)

    def reset_hooks(self, clear_contexts: bool = True, including_permanent: bool = False) -> None:
        self.registry.reset(including_permanent)
        if clear_contexts:
            self.engine.on_workers("clear_contexts")

    @contextmanager
    def hooks(
        self, fwd_hooks: FwdHooks = (), reset_hooks_end: bool = True, clear_contexts: bool = False
    ) -> Iterator[HookedVLLM]:
        """``with model.hooks(fwd_hooks=[(name, fn)]):`` — hooks for the calls in the block."""
        before = list(self.registry.added)
        try:
            for name, function in fwd_hooks:
                self.add_hook(name, function)
            yield self
        finally:
            if reset_hooks_end:
                self.registry.added = before
                if clear_contexts:
                    self.engine.on_workers("clear_contexts")

    def run_with_hooks(
        self,
        input: Input,
        fwd_hooks: FwdHooks = (),
        reset_hooks_end: bool = True,
        clear_contexts: bool = False,
        return_type: Literal["logits"] | None = "logits",
    ) -> Float[Tensor, "batch pos d_vocab"] | None:
        """One forward over the prompts with ``fwd_hooks`` (and any added hooks) applied."""
        with self.hooks(fwd_hooks, reset_hooks_end, clear_contexts):
            logits, _ = self.run_with_cache(input, names_filter=[], return_type=return_type)
        return logits

    # ---- caching -----------------------------------------------------------------------------

    def run_with_cache(
        self,
        input: Input,
        names_filter: NamesFilter = None,
        return_type: Literal["logits"] | None = "logits",
        max_new_tokens: int = 0,
        steering: Sequence[Steer] = (),
        prompt_steering: Sequence[Sequence[Steer]] | None = None,
        device: str | torch.device | None = None,
    ) -> tuple[Float[Tensor, "batch pos d_vocab"] | None, VLensCache]:
        """Run the prompts through vLLM and return ``(logits, cache)``; added hooks apply.

        Logits are at every position; prompts of different lengths are right-padded with zeros,
        and ``cache.lengths`` / ``cache.attention_mask`` tell real positions from padding.

        With ``max_new_tokens=n`` each prompt is also continued greedily by ``n`` tokens and the
        cache covers the decode steps too: positions ``prompt + n - 1`` (the last sampled token
        is never run through the model). ``cache.tokens`` holds the token at every position.
        ``steering`` / ``prompt_steering`` as in :meth:`generate`.

        ``device``: where the cache (and logits) are kept, as TransformerLens's ``device``;
        the CPU unless given (vLLM claims most of a GPU's memory for its KV cache). Keeping
        them on the engine's GPU (``device="cuda"``) saves the copy to the host.

        On a compiled engine ``names_filter`` picks among the names declared in
        ``compiled_capture`` (None: all of them).
        """
        if return_type not in ("logits", None):
            raise ValueError(f"return_type must be 'logits' or None, not {return_type!r}")
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, not {max_new_tokens}")
        prompts = self.token_lists(input)
        device = torch.device("cpu" if device is None else device)
        if device.type != "cpu" and self.engine.tensor_parallel_size > 1:
            raise NotImplementedError(
                f"device={str(device)!r}: under tensor parallelism values come back through "
                f"another process, on the CPU; leave device out"
            )
        self._admit_raw(names_filter, decoding=max_new_tokens > 1)
        self._admit_raw([hook.name for hook in self.registry.added], decoding=max_new_tokens > 1)
        known = list(self.hook_specs)
        if names_filter is None or callable(names_filter):  # raw locations only when named
            known = [name for name in self.hook_names if self._served(name)]
        names = [] if names_filter == [] else select_names(names_filter, list(known), self.explain)
        wanted = names + ([LOGITS] if return_type == "logits" and LOGITS not in names else [])
        kept = self._site_names(wanted)
        self._refuse_outside_graph(kept, return_type)
        hooks = self.registry.resolve(())
        steers = self._steering(steering, prompt_steering, len(prompts))
        plans = [self._plan(i, kept, hooks, steers[i]) for i in range(len(prompts))]
        run = self._run(prompts, plans, self._greedy(max_new_tokens), str(device))
        captures, whole_steps, sampled, _ = run
        generated = sampled if max_new_tokens else [[] for _ in prompts]
        tokens = [p + g[: max(0, len(g) - 1)] for p, g in zip(prompts, generated)]
        lengths = torch.tensor([len(t) for t in tokens])
        sampled_lengths = torch.tensor([len(s) for s in sampled])
        values = {
            name: self._padded(
                name,
                captures,
                whole_steps,
                sampled_lengths if self._per_sample(name) else lengths,
            )
            for name in kept
        }
        batch = Batch(
            mask=(torch.arange(int(lengths.max()))[None] < lengths[:, None]).to(device),
            weights=WeightsOn(self.weights, device),
            sampled=pad_batch([torch.tensor(tokens) for tokens in sampled]).to(device),
        )
        for name in wanted:
            self._derive(name, values, batch)
        shapes = {name: self.hook_specs[name].shape for name in names}
        cache = VLensCache({name: values[name] for name in names}, self, lengths, shapes)
        cache.sampled_lengths = sampled_lengths
        cache.tokens = pad_batch([torch.tensor(t) for t in tokens])
        return (values[LOGITS] if return_type == "logits" else None), cache

    # ---- generation --------------------------------------------------------------------------

    def generate(
        self,
        input: Input,
        max_new_tokens: int = 10,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int | None = None,
        do_sample: bool = True,
        stop_at_eos: bool = True,
        seed: int | None = None,
        fwd_hooks: FwdHooks = (),
        prompt_hooks: Sequence[FwdHooks] | None = None,
        return_type: Literal["input", "str", "tokens", "result"] = "input",
        steering: Sequence[Steer] = (),
        prompt_steering: Sequence[Sequence[Steer]] | None = None,
    ) -> str | list[str] | list[list[int]] | list[Generation]:
        """Continue each prompt by up to ``max_new_tokens`` tokens, with hooks applied at prefill
        and at every decode step.

        ``fwd_hooks`` (and hooks added with :meth:`add_hook`) apply to every prompt;
        ``prompt_hooks[i]`` to prompt ``i`` only, so one batch can mix steered and plain prompts.
        ``steering`` (:class:`~vlens.steering.Steer` values) applies to every prompt and
        ``prompt_steering[i]`` to prompt ``i``: steering as data, which a compiled engine runs
        inside its graph (hook functions need an eager engine). Returns, as TransformerLens does,
        prompt + completion: text for text input (``return_type="input"``), or ``"str"`` /
        ``"tokens"`` explicitly; ``"result"`` gives each finished request as a
        :class:`Generation` (prompt and new token ids, new text, why it stopped).
        """
        from vllm import SamplingParams

        prompts = self.token_lists(input)
        added = [hook.name for hook in self.registry.added]
        for hooks in [fwd_hooks, added, *(prompt_hooks or [])]:
            self._admit_raw(list(hooks), decoding=max_new_tokens > 1)
        if prompt_hooks is not None and len(prompt_hooks) != len(prompts):
            raise ValueError(f"prompt_hooks has {len(prompt_hooks)} entries for {len(prompts)} prompts")
        shared = self.registry.resolve(fwd_hooks)
        steers = self._steering(steering, prompt_steering, len(prompts))
        plans = []
        for index in range(len(prompts)):
            own = {} if prompt_hooks is None else self.registry.resolve(prompt_hooks[index], False)
            hooks = {name: shared.get(name, ()) + own.get(name, ()) for name in {*shared, *own}}
            self._refuse_python_in_graph(list(hooks))
            plans.append(self._plan(index, [], hooks, steers[index]))
        params = SamplingParams(
            max_tokens=max_new_tokens,
            temperature=temperature if do_sample else 0.0,
            top_p=top_p,
            top_k=top_k or 0,
            seed=seed,
            ignore_eos=not stop_at_eos,
        )
        _, _, generated, reasons = self._run(prompts, plans, params)
        if return_type == "result":
            return [
                Generation(prompt, new, self.to_string(new), reason)
                for prompt, new, reason in zip(prompts, generated, reasons)
            ]
        sequences = [prompt + new for prompt, new in zip(prompts, generated)]
        as_text = return_type == "str" or (
            return_type == "input" and (isinstance(input, str) or _is_texts(input))
        )
        if not as_text:
            return sequences
        texts = [self.to_string(sequence) for sequence in sequences]
        return texts[0] if isinstance(input, str) else texts

    # ---- the compiled tier and steering ------------------------------------------------------

    def _served(self, name: str) -> bool:
        """Whether this engine can give ``name``: any name in eager mode; on a compiled engine,
        a name traced into its graph, read outside the forward (the sampler's names), or
        derived from such names only."""
        if self.compiled is None:
            return True
        return all(self._in_graph_or_after(site) for site in self.registry.site_sources(name))

    def _in_graph_or_after(self, name: str) -> bool:
        """On a compiled engine: whether ``name`` is traced into its graph or read after the
        forward (the sampler's names), so that no hook of the forward is needed for it."""
        return name in self.compiled.capture or self._per_sample(name)

    def _refuse_outside_graph(self, kept: list[str], return_type: str | None) -> None:
        if self.compiled is None:
            return
        missing = [name for name in kept if not self._in_graph_or_after(name)]
        if not missing:
            return
        if missing == [LOGITS] and return_type == "logits":
            raise ValueError(
                f"return_type='logits' reads {LOGITS}, which this compiled engine does not "
                f"capture: add it to compiled_capture when loading, or pass return_type=None"
            )
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        shown = ", ".join(missing[:5]) + more
        raise ValueError(
            f"{shown} not traced into this compiled engine's graph (it captures "
            f"{len(self.compiled.capture)} names, declared when it was loaded): load it with them "
            f"in compiled_capture, or use {EAGER} to read any name"
        )

    def _refuse_python_in_graph(self, names: Sequence[str]) -> None:
        """Hook functions cannot run inside a compiled graph: say what to do instead."""
        if self.compiled is None:
            return
        inside = [name for name in names if not self._per_sample(name)]
        if inside:
            raise ValueError(
                f"a Python hook function on {inside[0]} cannot run on this compiled engine: its "
                f"forward is a traced graph. Steer as data instead (generate(..., steering="
                f"[Steer({inside[0]!r}, add=vector)]) with the name in compiled_steering), or "
                f"load {EAGER} for hook functions"
            )

    def _steering(
        self,
        steering: Sequence[Steer],
        prompt_steering: Sequence[Sequence[Steer]] | None,
        n_prompts: int,
    ) -> list[tuple[Steer, ...]]:
        """Each prompt's steers, by canonical name, checked against this engine."""
        if prompt_steering is not None and len(prompt_steering) != n_prompts:
            raise ValueError(
                f"prompt_steering has {len(prompt_steering)} entries for {n_prompts} prompts"
            )
        per_prompt = []
        for index in range(n_prompts):
            own = list(steering) + list(prompt_steering[index] if prompt_steering else ())
            resolved = [self._resolved_steer(steer) for steer in own]
            per_prompt.append(tuple(steers_by_name(resolved, f"prompt {index}").values()))
        return per_prompt

    def _resolved_steer(self, steer: Steer) -> Steer:
        if not isinstance(steer, Steer):
            raise TypeError(f"steering takes Steer values, got {type(steer).__name__}")
        name = self.registry.names(steer.name)[0]
        if self.compiled is not None and name not in self.compiled.steering:
            raise ValueError(
                f"{name} is not in this compiled engine's compiled_steering (declared when it "
                f"was loaded: {sorted(self.compiled.steering) or 'none'}); load it with "
                f"compiled_steering=[{name!r}], or use {EAGER}"
            )
        check_steerable(name, self.hook_specs[name])
        resolved = dataclasses.replace(steer, name=name)
        resolved.terms(self._width(name))  # sizes checked here, before any request runs
        return resolved

    def _width(self, name: str) -> int:
        spec = self.hook_specs[name]
        assert isinstance(spec, HookSpec)
        return math.prod(per_position_shape(spec, self.hf_config))

    # ---- running requests --------------------------------------------------------------------

    def _site_names(self, names: list[str]) -> list[str]:
        """The names read from vLLM sites that ``names`` need (derived names' sources included)."""
        needed = {site for name in names for site in self.registry.site_sources(name)}
        return [name for name in self.hook_specs if name in needed]

    def _plan(
        self,
        index: int,
        kept: list[str],
        hooks: dict[str, tuple[HookFunction, ...]],
        steers: tuple[Steer, ...] = (),
    ) -> RequestPlan:
        """Request ``index``'s names by site, in forward order: each with its hook functions and
        whether its value is kept for the cache. On a compiled engine the traced names go to
        the graph, and so do the steers; on an eager one steers become hook functions."""
        if self.compiled is not None:
            graph_keep = frozenset(name for name in kept if name in self.compiled.capture)
            kept = [name for name in kept if name not in graph_keep]
        else:
            graph_keep = frozenset()
            for steer in steers:
                function = as_hook_function(steer, self._width(steer.name))
                hooks = {**hooks, steer.name: (*hooks.get(steer.name, ()), function)}
            steers = ()
        sites: dict[Site, list[NamePlan]] = {}
        for name in self.hook_specs:
            if name not in hooks and name not in kept:
                continue
            spec = self.hook_specs[name]
            assert isinstance(spec, HookSpec)
            plan = NamePlan(name, spec.read, spec.arrange, hooks.get(name, ()), name in kept)
            sites.setdefault(spec.site, []).append(plan)
        by_site = {site: tuple(plans) for site, plans in sites.items()}
        return RequestPlan(index, by_site, graph_keep, steers)

    def _per_sample(self, name: str) -> bool:
        """Whether ``name`` has a value per sampled token (``sampler.*``), not per position."""
        spec = self.hook_specs[name]
        return isinstance(spec, HookSpec) and spec.site.event == "sampled"

    def _padded(
        self,
        name: str,
        captures: list[RequestCapture],
        whole_steps: dict[str, PaddedRows],
        lengths: Tensor,
    ) -> Tensor:
        spec = self.hook_specs[name]
        assert isinstance(spec, HookSpec)
        captured = [capture.chunks.get(name, []) for capture in captures]
        value = padded_batch(name, captured, whole_steps.get(name), lengths.tolist())
        return value if spec.arrange is None else rearrange(value, spec.arrange)

    def _derive(self, name: str, values: dict[str, Tensor], batch: Batch) -> Tensor:
        if name not in values:
            spec = self.hook_specs[name]
            assert isinstance(spec, DerivedSpec)
            sources = [self._derive(source, values, batch) for source in spec.sources]
            values[name] = spec.compute(sources, batch)
        return values[name]

    @staticmethod
    def _greedy(max_new_tokens: int) -> Any:
        """Greedy decoding; one token (discarded) when only the prompt's forward is wanted."""
        from vllm import SamplingParams

        return SamplingParams(max_tokens=max(1, max_new_tokens), temperature=0.0)

    def _run(
        self, prompts: list[list[int]], plans: list[RequestPlan], params: Any, device: str = "cpu"
    ) -> tuple[list[RequestCapture], dict[str, PaddedRows], list[list[int]], list[str | None]]:
        """Submit ``prompts`` together, each followed by its plan; returns what each captured
        where hook functions ran, what was read over whole steps (request ``i`` = prompt ``i``),
        the tokens each generated and why each stopped. A failure in one request's hooks is
        raised after the call."""
        from vllm.inputs import TokensPrompt

        call = next(_call_ids)
        tags = [f"{call}:{index}" for index in range(len(prompts))]
        request_params = []
        for tag in tags:
            # Shallow: vLLM deep-copies each request's parameters itself when it takes them in.
            own = copy.copy(params)
            own.extra_args = {**(params.extra_args or {}), TAG_KEY: tag}
            request_params.append(own)
        self.engine.on_workers("prepare", dict(zip(tags, plans)))
        try:
            outputs = self.engine.llm.generate(
                [TokensPrompt(prompt_token_ids=prompt) for prompt in prompts],
                request_params,
                use_tqdm=False,
            )
        finally:
            handback = self.engine.on_driver("finish", tags, device)
        captures = [handback.captures[tag] for tag in tags]
        for index, capture in enumerate(captures):
            if capture.error is not None:
                raise HookError(f"prompt {index}: {capture.error}") from capture.cause
        completions = [output.outputs[0] for output in outputs]
        tokens = [list(completion.token_ids) for completion in completions]
        reasons = [completion.finish_reason for completion in completions]
        return captures, handback.padded, tokens, reasons


def all_specs(mapping: ArchitectureMapping, config: PretrainedConfig) -> dict[str, Spec]:
    """Every name of a model: its architecture's, then the sampler's."""
    return {**mapping.expanded(config), **SAMPLER_NAMES}


def _is_texts(input: Input) -> bool:
    return isinstance(input, (list, tuple)) and len(input) > 0 and isinstance(input[0], str)
