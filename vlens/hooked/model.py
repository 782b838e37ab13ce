"""``HookedVLLM``: TransformerLens's ``HookedTransformer`` habits on a vLLM engine."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal, NamedTuple, NoReturn

import torch
from jaxtyping import Float, Int
from torch import Tensor
from transformer_lens.utilities import lm_cross_entropy_loss
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from vlens.analysis.weights import AnalysisWeights
from vlens.engine.cache import VLensCache, assemble
from vlens.engine.link import Engine, greedy
from vlens.engine.memory_budget import check_cache_fits
from vlens.engine.planning import LOGITS, HooksByName, Planner
from vlens.engine.support import (
    check_cache_device,
    check_loadable,
    model_impl_args,
    refuse_gradients,
)
from vlens.hooked.config import ModelConfig
from vlens.hooked.generation import GenerateMethods, check_max_new_tokens
from vlens.hooked.hook_registry import FwdHooks, HookRegistry, NameOrFilter
from vlens.hooked.module_surface import ModuleSurface
from vlens.hooked.outputs import (
    Output,
    ReturnType,
    check_return_type,
    computed_before,
    model_output,
    residual_entering,
    stopping_layer,
)
from vlens.hooked.saes import SAEMethods
from vlens.hooked.tokens import Input, TokenMethods, prepare_tokenizer
from vlens.hooked.views import ModelViews
from vlens.mappings import mapping_for
from vlens.names.checkpoint import CheckpointWeights
from vlens.names.compiled import CompiledNames, declare, declare_saes
from vlens.names.derived import SampledTokens
from vlens.names.mapping import ArchitectureMapping, DerivedSpec, HookSpec, Site, Spec
from vlens.names.raw import RawLocations, SourceListing
from vlens.names.resolve import NamesFilter, select_names
from vlens.runtime.messages import HookFunction
from vlens.runtime.readers import OutputOf
from vlens.runtime.steering import AnySteer
from vlens.sae.autoencoder import SAE

#: Engine-level names, the same for every architecture, one row per sampled token: each step's
#: logits for the token a request samples next, as the sampler receives them (editable: a hook
#: can ban or boost tokens for one request), and the token it sampled (read-only).
SAMPLER_NAMES: dict[str, Spec] = {
    "sampler.hook_logits": HookSpec(Site("logits_processor", "sampled"), OutputOf(), "new_pos d_vocab"),
    "sampler.hook_tokens": DerivedSpec((), SampledTokens(), "new_pos"),
}


class HookedVLLM(TokenMethods, GenerateMethods, ModelViews, ModuleSurface, SAEMethods):
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
        default_prepend_bos: bool | None = None,
        default_padding_side: Literal["left", "right"] | None = None,
    ) -> None:
        self.engine = engine
        self.weights = CheckpointWeights(path)
        self.hf_config = config
        self.compiled = compiled
        self.hook_specs: dict[str, Spec] = all_specs(mapping, config, compiled)
        self.canonical_names = list(self.hook_specs)
        self.tokenizer = prepare_tokenizer(tokenizer, default_padding_side)
        self.cfg = ModelConfig.from_hf(
            config,
            mapping,
            list(self.hook_specs),
            tokenizer=self.tokenizer,
            default_prepend_bos=default_prepend_bos,
            default_padding_side=default_padding_side,
        )
        self.explain = mapping.unavailable
        self.registry = HookRegistry(
            self.hook_specs, self.explain, tensor_parallel_size=engine.tensor_parallel_size
        )
        self.planner = Planner(self.hook_specs, self.registry, config, compiled)
        self.raw = RawLocations(
            self.hook_specs,
            self.canonical_names,
            lambda: engine.watch_modules(self.token_lists("probe")[0]),
            compiled is not None,
            engine.tensor_parallel_size,
            lambda path: engine.operations(path),
        )
        self.analysis = AnalysisWeights(self.weights, mapping.weights, config, self.cfg.n_heads)

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        compiled_capture: NamesFilter | Sequence[str] = (),
        compiled_steering: NamesFilter | Sequence[str] = (),
        compiled_hooks: NamesFilter | Sequence[str] = (),
        default_prepend_bos: bool | None = None,
        default_padding_side: Literal["left", "right"] | None = None,
        compiled_saes: dict[str, SAE | str | Path] | None = None,
        compiled_sae_slots: int = 1024,
        compiled_sae_top_k: int | None = None,
        **engine_kwargs: Any,
    ) -> HookedVLLM:
        """Load a local HuggingFace checkpoint into vLLM; ``engine_kwargs`` go to ``vllm.LLM``
        (``dtype``, ``max_model_len``, ...). vlens turns off prefix caching.

        Strings are tokenized as TransformerLens does: ``default_prepend_bos`` (None: the
        architecture's TransformerLens default, True for most) and ``default_padding_side``
        (None: the tokenizer's) as in TransformerLens's ``from_pretrained``; pass
        ``prepend_bos=False`` to a call to keep the text's own tokens (e.g. a chat template).

        Without compiled names the engine runs eager: every name can be read and hooked with
        Python functions. With ``compiled_capture`` (names to read; lists or name filters) and/or
        ``compiled_steering`` (names :class:`~vlens.runtime.steering.Steer` values may change) it runs in
        vLLM's compiled mode (torch.compile, and CUDA graphs on a GPU) with those names traced
        into the graph: much faster generation, but only the declared names, and steering as
        data instead of hook functions. ``compiled_hooks`` (names or name filters) declares the
        names where TransformerLens hook functions run inside the compiled graph, with the eager
        engine's semantics; each can also be read and steered there.

        ``compiled_saes`` (a name for each SAE -> the SAE, or the folder SAELens saved it in)
        puts SAEs into the graph: :class:`~vlens.runtime.steering.SAESteer` values edit their
        features per request (at most ``compiled_sae_slots`` distinct features of one SAE among
        a call's or a server's requests at once), and with ``compiled_sae_top_k`` each SAE's
        ``top_k`` largest features per position are names to read
        (``{hook_name}.hook_sae_acts_post.top_k_values`` and ``.top_k_indices``).
        """
        model = checkpoint_of(
            path, compiled_capture, compiled_steering, engine_kwargs, compiled_hooks,
            compiled_saes, compiled_sae_slots, compiled_sae_top_k,
        )
        graph_names = model.compiled.graph_names if model.compiled else ()
        engine_kwargs = {**model_impl_args(model.mapping), **engine_kwargs}
        engine = Engine(str(path), graph_names, model.mapping.cpu_engine_args, **engine_kwargs)
        return cls(
            engine,
            Path(path),
            model.config,
            model.tokenizer,
            model.mapping,
            model.compiled,
            default_prepend_bos,
            default_padding_side,
        )

    @property
    def hook_names(self) -> list[str]:
        """Every canonical hook name of this model, in forward order."""
        return list(self.canonical_names)

    def __repr__(self) -> str:
        return self.engine.module_tree()

    def source(self, path: str) -> SourceListing:
        """The operations of the forward of vLLM's module at ``path`` (``print(model)`` shows
        the paths), in the order they run, each a raw location: ``print(model.source(
        "model.layers.10.self_attn"))`` lists ``qkv_split_0``, ``self_rotary_emb_0``, ...;
        ``model.layers.10.self_attn.source.self_rotary_emb_0.output.0`` is the rotated query."""
        return self.raw.source(path)

    @property
    def original_model(self) -> NoReturn:
        """TransformerLens's bridge wraps a HuggingFace model here; vLLM holds none."""
        raise AttributeError(
            "original_model: TransformerLens's bridge wraps a HuggingFace model, but vlens runs "
            "the checkpoint in vLLM and holds no HuggingFace module; for a HuggingFace reference "
            "load one yourself: transformers.AutoModelForCausalLM.from_pretrained("
            f"{str(self.weights.folder)!r})"
        )

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
            refuse_gradients(f"add_hook(dir={dir!r})")
        self.raw.admit(name)
        self.planner.check_hook_functions(self.registry.names(name))
        self.registry.add(name, hook, is_permanent)

    def reset_hooks(self, clear_contexts: bool = True, including_permanent: bool = False) -> None:
        self.registry.reset(including_permanent)
        if clear_contexts:
            self.engine.clear_contexts()

    @contextmanager
    def hooks(
        self,
        fwd_hooks: FwdHooks = (),
        bwd_hooks: FwdHooks = (),
        reset_hooks_end: bool = True,
        clear_contexts: bool = False,
    ) -> Iterator[HookedVLLM]:
        """``with model.hooks(fwd_hooks=[(name, fn)]):`` — hooks for the calls in the block."""
        if bwd_hooks:
            refuse_gradients("bwd_hooks")
        before = list(self.registry.added)
        try:
            for name, function in fwd_hooks:
                self.add_hook(name, function)
            yield self
        finally:
            if reset_hooks_end:
                self.registry.added = before
                if clear_contexts:
                    self.engine.clear_contexts()

    def run_with_hooks(
        self,
        input: Input,
        fwd_hooks: FwdHooks = (),
        bwd_hooks: FwdHooks = (),
        reset_hooks_end: bool = True,
        clear_contexts: bool = False,
        **forward_kwargs: Any,
    ) -> Output:
        """:meth:`forward` with ``fwd_hooks`` (and any added hooks) applied."""
        with self.hooks(fwd_hooks, bwd_hooks, reset_hooks_end, clear_contexts):
            return self.forward(input, **forward_kwargs)

    def forward(
        self,
        input: Input,
        return_type: ReturnType = "logits",
        loss_per_token: bool = False,
        prepend_bos: bool | None = None,
        padding_side: Literal["left", "right"] | None = None,
        start_at_layer: int | None = None,
        stop_at_layer: int | None = None,
        prompt_hooks: Sequence[FwdHooks] | None = None,
    ) -> Output:
        """TransformerLens's forward: ``model(input, return_type="logits" | "loss" | "both" |
        None)``, with added hooks applied (``prompt_hooks[i]``: hooks for prompt ``i`` only).
        With ``stop_at_layer=k`` it returns the residual stream entering block ``k``."""
        if start_at_layer is not None:
            raise NotImplementedError(
                "start_at_layer: vLLM's forward starts from token ids; to run from a residual "
                "stream of your own, replace it with a hook on blocks.{k}.hook_resid_pre"
            )
        output, _ = self.run_with_cache(
            input,
            names_filter=[],
            return_type=return_type,
            loss_per_token=loss_per_token,
            prepend_bos=prepend_bos,
            padding_side=padding_side,
            stop_at_layer=stop_at_layer,
            prompt_hooks=prompt_hooks,
        )
        return output

    __call__ = forward

    def loss_fn(
        self,
        logits: Float[Tensor, "batch pos d_vocab"],
        tokens: Int[Tensor, "batch pos"],
        attention_mask: Tensor | None = None,
        per_token: bool = False,
    ) -> Tensor:
        """TransformerLens's next-token cross-entropy (its own ``lm_cross_entropy_loss``)."""
        mask = None if attention_mask is None else attention_mask.to(logits.device)
        return lm_cross_entropy_loss(logits, tokens.to(logits.device), mask, per_token)

    # ---- caching -----------------------------------------------------------------------------

    def run_with_cache(
        self,
        input: Input,
        names_filter: NamesFilter = None,
        return_type: ReturnType = "logits",
        loss_per_token: bool = False,
        prepend_bos: bool | None = None,
        padding_side: Literal["left", "right"] | None = None,
        stop_at_layer: int | None = None,
        remove_batch_dim: bool = False,
        return_cache_object: bool = True,
        max_new_tokens: int = 0,
        steering: Sequence[AnySteer] = (),
        prompt_steering: Sequence[Sequence[AnySteer]] | None = None,
        prompt_hooks: Sequence[FwdHooks] | None = None,
        device: str | torch.device | None = None,
        incl_bwd: bool = False,
    ) -> tuple[Output, VLensCache | dict[str, Tensor]]:
        """Run the prompts through vLLM and return ``(output, cache)``; added hooks apply.

        ``output`` is what :meth:`forward` returns for ``return_type`` (logits at every
        position by default). Prompts of different lengths are right-padded with zeros, and
        ``cache.lengths`` / ``cache.attention_mask`` tell real positions from padding.

        With ``max_new_tokens=n`` each prompt is also continued greedily by ``n`` tokens and the
        cache covers the decode steps too: positions ``prompt + n - 1`` (the last sampled token
        is never run through the model). ``cache.tokens`` holds the token at every position.
        ``steering`` / ``prompt_steering`` / ``prompt_hooks`` as in :meth:`generate`.

        ``device``: where the cache (and logits) are kept, as TransformerLens's ``device``;
        the CPU unless given (vLLM claims most of a GPU's memory for its KV cache). Keeping
        them on the engine's GPU (``device="cuda"``) saves the copy to the host.

        On a compiled engine ``names_filter`` picks among the names declared in
        ``compiled_capture`` (None: all of them).

        Attention scores and patterns (``heads × pos × pos`` per prompt) are built when first
        read. A call whose cache would not fit in the memory available on ``device`` is refused
        before it runs (:mod:`vlens.engine.memory_budget`).
        """
        if incl_bwd:
            refuse_gradients("run_with_cache(incl_bwd=True)")
        check_return_type(return_type)
        check_max_new_tokens(max_new_tokens, least=0)
        prompts = self.token_lists(input, prepend_bos, padding_side)
        self._warn_if_cut_short(prompts, max_new_tokens)
        device = torch.device("cpu" if device is None else device)
        check_cache_device(device, self.engine.tensor_parallel_size)
        hooks = self._hooks_per_prompt((), prompt_hooks, len(prompts), max_new_tokens > 1)
        names_filter, groups = self.raw.grouped(names_filter)
        self.raw.admit(names_filter, max_new_tokens > 1)
        known = list(self.hook_specs)
        if names_filter is None or callable(names_filter):  # raw locations only when named
            known = [name for name in self.hook_names if self.planner.served(name)]
        names = [] if names_filter == [] else select_names(names_filter, known, self.explain)
        if stop_at_layer is not None:
            stop = stopping_layer(stop_at_layer, self.cfg.n_layers)
            names = [name for name in names if computed_before(name, stop)]
            result = residual_entering(stop, self.cfg.n_layers)
        else:
            result = LOGITS if return_type is not None else None
        wanted = names + ([result] if result is not None and result not in names else [])
        kept = self.planner.site_names(wanted)
        self.planner.check_graph_reads(kept, return_type)
        build_all = not return_cache_object
        check_cache_fits(self, prompts, max_new_tokens, wanted, kept, device, build_all)
        steers = self.planner.steering(steering, prompt_steering, len(prompts))
        plans = self.planner.plans(kept, hooks, steers, self.registry.resolve(()))
        run = self.engine.run(prompts, plans, greedy(max_new_tokens), str(device))
        values, cache = assemble(
            self, run, prompts, max_new_tokens > 0, names, wanted, kept, device
        )
        if stop_at_layer is not None:
            output: Output = values[result]
        else:
            logits = values.get(LOGITS)
            mask = cache.attention_mask
            output = model_output(return_type, logits, cache.tokens, mask, loss_per_token)
        cache.groups = groups
        if remove_batch_dim:
            cache.remove_batch_dim(len(prompts))
        return output, (cache if return_cache_object else dict(cache.cache_dict))

    def _hooks_per_prompt(
        self,
        fwd_hooks: FwdHooks,
        prompt_hooks: Sequence[FwdHooks] | None,
        n_prompts: int,
        decoding: bool,
    ) -> list[HooksByName]:
        """Each prompt's hook functions by canonical name: the added ones, ``fwd_hooks``, then
        its own ``prompt_hooks[i]``; raw locations admitted (``decoding``: past the prefill)."""
        if prompt_hooks is not None and len(prompt_hooks) != n_prompts:
            raise ValueError(f"prompt_hooks has {len(prompt_hooks)} entries for {n_prompts} prompts")
        added = [hook.name for hook in self.registry.added]
        for hooks in [fwd_hooks, added, *(prompt_hooks or [])]:
            self.raw.admit(list(hooks), decoding)
        shared = self.registry.resolve(fwd_hooks)
        per_prompt = []
        for index in range(n_prompts):
            own = {} if prompt_hooks is None else self.registry.resolve(prompt_hooks[index], False)
            hooks = {name: shared.get(name, ()) + own.get(name, ()) for name in {*shared, *own}}
            self.planner.check_hook_functions(list(hooks))
            per_prompt.append(hooks)
        return per_prompt

    # ---- TransformerLens's settings ----------------------------------------------------------

    def set_use_attn_result(self, use_attn_result: bool) -> None:
        """Accepted: ``attn.hook_result`` is always offered (computed from ``hook_z`` and W_O),
        and hooks on it edit the attention output."""

    def set_use_split_qkv_input(self, use_split_qkv_input: bool) -> None:
        """Accepted: ``hook_q_input`` / ``hook_k_input`` / ``hook_v_input`` are always offered."""

    def set_use_hook_mlp_in(self, use_hook_mlp_in: bool) -> None:
        """Accepted: ``hook_mlp_in`` is always offered."""

    def set_use_attn_in(self, use_attn_in: bool) -> None:
        """Accepted: ``hook_attn_in`` is always offered."""


class Checkpoint(NamedTuple):
    """What a model is made of before its engine: config, mapping, compiled names, tokenizer."""

    config: PretrainedConfig
    mapping: ArchitectureMapping
    compiled: CompiledNames | None
    tokenizer: PreTrainedTokenizerBase


def checkpoint_of(
    path: str | Path,
    compiled_capture: NamesFilter | Sequence[str],
    compiled_steering: NamesFilter | Sequence[str],
    engine_kwargs: dict[str, Any],
    compiled_hooks: NamesFilter | Sequence[str] = (),
    compiled_saes: dict[str, SAE | str | Path] | None = None,
    compiled_sae_slots: int = 1024,
    compiled_sae_top_k: int | None = None,
) -> Checkpoint:
    """A checkpoint's config and mapping, refused before any engine starts where vlens cannot
    serve it with these engine arguments, and its compiled names declared (None: eager)."""
    config = AutoConfig.from_pretrained(path)
    mapping = mapping_for(config)
    wants_graph = bool(compiled_capture or compiled_steering or compiled_hooks or compiled_saes)
    check_loadable(mapping, config.architectures[0], engine_kwargs, wants_graph)
    if compiled_sae_top_k is not None and not compiled_saes:
        raise ValueError("compiled_sae_top_k without compiled_saes: declare the SAEs it reads")
    compiled = None
    if wants_graph:
        specs = all_specs(mapping, config)
        compiled = declare(
            specs, config, compiled_capture, compiled_steering, mapping.unavailable, compiled_hooks
        )
        if compiled_saes:
            saes = declare_saes(compiled_saes, specs, config, compiled_sae_slots,
                                compiled_sae_top_k, mapping.unavailable)
            compiled = compiled.with_saes(saes, specs, config)
    return Checkpoint(config, mapping, compiled, AutoTokenizer.from_pretrained(path))


def all_specs(
    mapping: ArchitectureMapping, config: PretrainedConfig, compiled: CompiledNames | None = None
) -> dict[str, Spec]:
    """Every name of a model: its architecture's (each compiled SAE's top-k names after the
    name it reads), then the sampler's."""
    specs = mapping.expanded(config)
    for compiled_sae in (compiled.saes.values() if compiled is not None else ()):
        hook = specs[compiled_sae.hook]
        assert isinstance(hook, HookSpec)
        added = {
            name: dataclasses.replace(hook, shape=f"pos {compiled_sae.top_k}", arrange=None)
            for name in compiled_sae.captured_names
        }
        order = list(specs.items())
        at = list(specs).index(compiled_sae.hook) + 1
        specs = dict(order[:at] + list(added.items()) + order[at:])
    return {**specs, **SAMPLER_NAMES}
