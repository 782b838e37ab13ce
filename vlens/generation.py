"""``generate``: TransformerLens's generation arguments and results, with hooks and steering at
prefill and at every decode step, each prompt one vLLM request."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from vlens.hook_registry import FwdHooks
from vlens.steering import Steer
from vlens.tokens import Input, is_texts


@dataclass(frozen=True)
class Generation:
    """One finished request of :meth:`HookedVLLM.generate`."""

    prompt_tokens: list[int]
    tokens: list[int]  # the generated ones
    text: str  # the generated text
    finish_reason: str | None  # "length", "stop", ...


class GenerateMethods:
    """Mixed into :class:`~vlens.HookedVLLM`: ``generate`` over its engine, planner and hooks."""

    engine: Any
    planner: Any
    registry: Any
    tokenizer: Any
    token_lists: Any
    _hooks_per_prompt: Any

    def generate(
        self,
        input: Input,
        max_new_tokens: int = 10,
        stop_at_eos: bool = True,
        eos_token_id: int | Sequence[int] | None = None,
        do_sample: bool = True,
        top_k: int | None = None,
        top_p: float | None = None,
        temperature: float = 1.0,
        freq_penalty: float = 0.0,
        use_past_kv_cache: bool = True,
        prepend_bos: bool | None = None,
        padding_side: Literal["left", "right"] | None = None,
        return_type: Literal["input", "str", "tokens", "result"] = "input",
        verbose: bool = True,
        seed: int | None = None,
        fwd_hooks: FwdHooks = (),
        prompt_hooks: Sequence[FwdHooks] | None = None,
        steering: Sequence[Steer] = (),
        prompt_steering: Sequence[Sequence[Steer]] | None = None,
    ) -> str | list[str] | list[list[int]] | list[Generation]:
        """Continue each prompt by up to ``max_new_tokens`` tokens, with hooks applied at prefill
        and at every decode step; TransformerLens's arguments and return types.

        ``fwd_hooks`` (and hooks added with :meth:`add_hook`) apply to every prompt;
        ``prompt_hooks[i]`` to prompt ``i`` only, so one batch can mix steered and plain prompts.
        ``steering`` (:class:`~vlens.steering.Steer` values) applies to every prompt and
        ``prompt_steering[i]`` to prompt ``i``: steering as data, which a compiled engine runs
        inside its graph (hook functions need an eager engine). Returns, as TransformerLens does,
        prompt + completion: text for text input (``return_type="input"``), or ``"str"`` /
        ``"tokens"`` explicitly; ``"result"`` gives each finished request as a
        :class:`Generation` (prompt and new token ids, new text, why it stopped).

        vLLM always decodes with its KV cache (``use_past_kv_cache=False`` gives the same
        tokens, slower in TransformerLens) and shows no progress bar (``verbose``).
        """
        from vllm import SamplingParams

        if freq_penalty:
            raise NotImplementedError(
                "freq_penalty: TransformerLens counts prompt and generated tokens, vLLM's "
                "frequency_penalty only generated ones; edit sampler.hook_logits in a hook instead"
            )
        prompts = self.token_lists(input, prepend_bos, padding_side, truncate=False)
        hooks = self._hooks_per_prompt(fwd_hooks, prompt_hooks, len(prompts), max_new_tokens > 1)
        steers = self.planner.steering(steering, prompt_steering, len(prompts))
        plans = self.planner.plans([], hooks, steers, self.registry.resolve(fwd_hooks))
        stops = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or [])
        params = SamplingParams(
            max_tokens=max_new_tokens,
            temperature=temperature if do_sample else 0.0,
            top_p=1.0 if top_p is None else top_p,
            top_k=top_k or 0,
            seed=seed,
            ignore_eos=not stop_at_eos or bool(stops),
            stop_token_ids=stops if stop_at_eos else [],
        )
        run = self.engine.run(prompts, plans, params)
        if return_type == "result":
            return [
                Generation(prompt, new, self._text(new), reason)
                for prompt, new, reason in zip(prompts, run.sampled, run.finish_reasons)
            ]
        sequences = [prompt + new for prompt, new in zip(prompts, run.sampled)]
        as_text = return_type == "str" or (
            return_type == "input" and (isinstance(input, str) or is_texts(input))
        )
        if not as_text:
            return sequences
        texts = [self._text(sequence) for sequence in sequences]
        return texts[0] if len(texts) == 1 else texts

    def _text(self, tokens: list[int]) -> str:
        """Generated text as TransformerLens returns it: special tokens (BOS) left out."""
        return self.tokenizer.decode(tokens, skip_special_tokens=True)
