"""``HookedVLLM``: TransformerLens's ``HookedTransformer`` habits on a vLLM engine."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Literal, NoReturn

import torch
from jaxtyping import Float, Int
from torch import Tensor
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from vlens.engine.arguments import architecture_args
from vlens.engine.assembly import assemble
from vlens.engine.checkpoint import Checkpoint
from vlens.engine.engine import Engine, greedy
from vlens.engine.memory_budget import check_cache_device, check_cache_fits
from vlens.engine.planning import HooksByName
from vlens.hooked import twin_models
from vlens.hooked.cache import VLensCache
from vlens.hooked.config import ModelConfig
from vlens.hooked.generation import GenerateMethods, check_max_new_tokens
from vlens.hooked.gradients import Gradients, admit
from vlens.hooked.hook_registry import FwdHooks, HookRegistry
from vlens.hooked.module_surface import ModuleSurface
from vlens.hooked.outputs import Output, ReturnType, check_return_type, model_output
from vlens.hooked.saes import SAEMethods
from vlens.hooked.tokens import Input, TokenMethods, prepare_tokenizer
from vlens.hooked.views import ModelViews
from vlens.names.compiled import LOGITS
from vlens.names.raw import RawLocations, SourceListing
from vlens.names.resolve import NamesFilter
from vlens.names.rules import NameOrFilter
from vlens.names.tl_versions import lm_cross_entropy_loss
from vlens.runtime.transfer.messages import HookFunction
from vlens.runtime.vocabulary.steering import AnySteer
from vlens.sae.autoencoder import SAE


class HookedVLLM(TokenMethods, GenerateMethods, ModelViews, ModuleSurface, SAEMethods, Gradients):
    """A vLLM engine that answers in TransformerLens hook names.

    Build it with :meth:`from_pretrained`; ``print(model)`` shows vLLM's module tree;
    :attr:`hook_names` lists every name this architecture offers.
    """

    def __init__(
        self,
        checkpoint: Checkpoint,
        engine: Engine,
        tokenizer: PreTrainedTokenizerBase,
        default_prepend_bos: bool | None = None,
        default_padding_side: Literal["left", "right"] | None = None,
    ) -> None:
        self.checkpoint = checkpoint
        self.engine = engine
        self.tokenizer = prepare_tokenizer(tokenizer, default_padding_side)
        self.cfg = ModelConfig.from_hf(
            checkpoint.hf_config,
            checkpoint.mapping,
            list(checkpoint.hook_specs),
            tokenizer=self.tokenizer,
            default_prepend_bos=default_prepend_bos,
            default_padding_side=default_padding_side,
        )
        self.registry = HookRegistry(checkpoint.rules, checkpoint.analysis)
        self.raw = RawLocations(
            checkpoint.hook_specs,
            checkpoint.canonical_names,
            lambda: engine.watch_modules(self.token_lists("probe")[0]),
            checkpoint.rules.check_raw_location,
            lambda path: engine.operations(path),
        )

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
        Python functions. With ``compiled_capture`` (names to read; lists, glob patterns or
        name filters) and/or ``compiled_steering`` (names
        :class:`~vlens.runtime.vocabulary.steering.Steer` values may change) it runs in vLLM's
        compiled mode (torch.compile, and CUDA graphs on a GPU) with those names traced into
        the graph: much faster generation, but only the declared names, and steering as data
        instead of hook functions. ``compiled_hooks`` declares the names where TransformerLens
        hook functions run inside the compiled graph, with the eager engine's semantics; each
        can also be read and steered there.

        ``compiled_saes`` (a name for each SAE -> the SAE, or the folder SAELens saved it in)
        puts SAEs into the graph: :class:`~vlens.runtime.vocabulary.steering.SAESteer` values
        edit their features per request (at most ``compiled_sae_slots`` distinct features of
        one SAE among a call's or a server's requests at once), and with ``compiled_sae_top_k``
        each SAE's ``top_k`` largest features per position are names to read
        (``{hook_name}.hook_sae_acts_post.top_k_values`` and ``.top_k_indices``).
        """
        checkpoint = Checkpoint.load(
            path, engine_kwargs, compiled_capture, compiled_steering, compiled_hooks,
            compiled_saes, compiled_sae_slots, compiled_sae_top_k, hooks_by_default=True,
        )
        engine_kwargs = {**architecture_args(checkpoint.mapping), **engine_kwargs}
        engine = Engine(str(path), checkpoint.graph_names, **engine_kwargs)
        tokenizer = AutoTokenizer.from_pretrained(path)
        return cls(checkpoint, engine, tokenizer, default_prepend_bos, default_padding_side)

    def close(self) -> None:
        """Let the model's memory go: vLLM's engine (weights, KV cache, workers) and the
        gradient twin. The model answers no call after; ``with HookedVLLM.from_pretrained(...)
        as model:`` closes it at the block's end."""
        self.free_gradient_twin()
        self.engine.close()

    def __enter__(self) -> HookedVLLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def hook_names(self) -> list[str]:
        """Every canonical hook name of this model, in forward order."""
        return list(self.checkpoint.canonical_names)

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
            f"{str(self.checkpoint.path)!r})"
        )

    # ---- hooks (TransformerLens's API) -------------------------------------------------------

    def add_hook(
        self,
        name: NameOrFilter,
        hook: HookFunction,
        dir: Literal["fwd", "bwd", "both"] = "fwd",
        is_permanent: bool = False,
    ) -> None:
        """Run ``hook(tensor, hook_point)`` at ``name`` (or every name a filter accepts) in every
        later call, until :meth:`reset_hooks`. It may return a replacement tensor, or edit the
        tensor in place and return None; either reaches the model. ``dir="bwd"`` (or
        ``"both"``): on the gradient at ``name``, as TransformerLens does; the forwards that
        follow run on the gradient twin (:mod:`vlens.hooked.gradients`)."""
        if dir not in ("fwd", "bwd", "both"):
            raise ValueError(f"dir must be 'fwd', 'bwd' or 'both', got {dir!r}")
        if dir != "bwd":
            self.raw.admit(name)
            self.registry.add(name, hook, is_permanent)
        if dir != "fwd":
            self.add_backward_hook(name, hook, is_permanent)

    def reset_hooks(self, clear_contexts: bool = True, including_permanent: bool = False) -> None:
        self.registry.reset(including_permanent)
        self.remove_backward_hooks(None, including_permanent)
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
        """``with model.hooks(fwd_hooks=[(name, fn)], bwd_hooks=[...]):`` — hooks for the calls
        in the block."""
        before = list(self.registry.added)
        with self.backward_hooks_kept() if reset_hooks_end else nullcontext():
            try:
                for name, function in fwd_hooks:
                    self.add_hook(name, function)
                for name, function in bwd_hooks:
                    self.add_hook(name, function, dir="bwd")
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
        if self.needs_gradients():
            edits, mask = self.twin_call(input, prepend_bos, padding_side, prompt_hooks)
            with self.on_twin("a forward", {}, edits) as twin:
                tokens = self.to_tokens(input, prepend_bos, padding_side).to(twin.cfg.device)
                layer = {} if stop_at_layer is None else {"stop_at_layer": stop_at_layer}
                return twin(tokens, return_type=return_type, loss_per_token=loss_per_token,
                            attention_mask=mask, **layer)
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
        position by default). Prompts of different lengths are padded with zeros on
        ``padding_side`` (None: the tokenizer's, ``cfg.default_padding_side``), as
        TransformerLens pads them, in the cache, the logits and every hook function's batch;
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
        check_return_type(return_type)
        if self.needs_gradients(incl_bwd):
            edits, mask = self.twin_call(input, prepend_bos, padding_side, prompt_hooks,
                                         steering, prompt_steering)
            with self.on_twin("run_with_cache", {"max_new_tokens": max_new_tokens > 0},
                              edits) as twin:
                tokens = self.to_tokens(input, prepend_bos, padding_side).to(twin.cfg.device)
                names = self.checkpoint.planner.names(names_filter)
                if isinstance(names_filter, str | list | tuple):
                    admit(twin, names)
                else:  # a filter passes over the names the bridge gates, as on the bridge
                    names = [name for name in names if not twin_models.gated_reason(twin, name)]
                return twin.run_with_cache(
                    tokens, names_filter=names,
                    return_type=return_type, loss_per_token=loss_per_token, incl_bwd=incl_bwd,
                    remove_batch_dim=remove_batch_dim, return_cache_object=return_cache_object,
                    stop_at_layer=stop_at_layer, attention_mask=mask,
                )
        check_max_new_tokens(max_new_tokens, least=0)
        prompts = self.token_lists(input, prepend_bos, padding_side)
        self._warn_if_cut_short(prompts, max_new_tokens)
        device = torch.device("cpu" if device is None else device)
        check_cache_device(device, self.engine.tensor_parallel_size)
        hooks, shared = self._hooks_per_prompt((), prompt_hooks, len(prompts), max_new_tokens > 1)
        names_filter, groups = self.raw.grouped(names_filter)
        self.raw.admit(names_filter, max_new_tokens > 1)
        call = self.checkpoint.planner.call(
            len(prompts), names_filter, hooks, shared, steering, prompt_steering, return_type,
            stop_at_layer, self._padding_side(padding_side),
        )
        check_cache_fits(self.checkpoint, call, prompts, max_new_tokens, device,
                         not return_cache_object, self.engine.dtype)
        run = self.engine.run(prompts, call.plans, greedy(max_new_tokens), str(device))
        assembled = assemble(self.checkpoint, call, run, prompts, max_new_tokens > 0, device)
        cache = VLensCache.of(assembled, self)
        if stop_at_layer is not None:
            assert call.result is not None
            output: Output = assembled.values[call.result]
        else:
            output = model_output(return_type, assembled.values.get(LOGITS), assembled.tokens,
                                  assembled.attention_mask, loss_per_token)
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
    ) -> tuple[list[HooksByName], HooksByName]:
        """Each prompt's hook functions by canonical name (the added ones, ``fwd_hooks``, then
        its own ``prompt_hooks[i]``), and those shared by every prompt (the added ones and
        ``fwd_hooks``); raw locations admitted (``decoding``: past the prefill)."""
        if prompt_hooks is not None and len(prompt_hooks) != n_prompts:
            raise ValueError(f"prompt_hooks has {len(prompt_hooks)} entries for {n_prompts} prompts")
        added = [hook.name for hook in self.registry.added]
        for hooks in [fwd_hooks, added, *(prompt_hooks or [])]:
            self.raw.admit(list(hooks), decoding)
        shared = self.registry.resolve(fwd_hooks)
        per_prompt = []
        for index in range(n_prompts):
            own = {} if prompt_hooks is None else self.registry.resolve(prompt_hooks[index], False)
            per_prompt.append({name: shared.get(name, ()) + own.get(name, ())
                               for name in {*shared, *own}})
        return per_prompt, shared

    # ---- TransformerLens's settings ----------------------------------------------------------

    def set_use_attn_result(self, use_attn_result: bool) -> None:
        """The engine always offers ``attn.hook_result`` (computed from ``hook_z`` and W_O; hooks
        on it edit the attention output); the gradient twin is switched as the bridge is."""
        self.switch_twin("use_attn_result", use_attn_result)

    def set_use_split_qkv_input(self, use_split_qkv_input: bool) -> None:
        """The engine always offers ``hook_q_input`` / ``hook_k_input`` / ``hook_v_input``; the
        gradient twin is switched as the bridge is."""
        self.switch_twin("use_split_qkv_input", use_split_qkv_input)

    def set_use_hook_mlp_in(self, use_hook_mlp_in: bool) -> None:
        """The engine always offers ``hook_mlp_in``; the gradient twin is switched as the bridge
        is."""
        self.switch_twin("use_hook_mlp_in", use_hook_mlp_in)

    def set_use_attn_in(self, use_attn_in: bool) -> None:
        """The engine always offers ``hook_attn_in``; the gradient twin is switched as the bridge
        is."""
        self.switch_twin("use_attn_in", use_attn_in)
