"""``generate``: TransformerLens's generation arguments and results, with hooks and steering at
prefill and at every decode step, each prompt one vLLM request."""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Any, Literal

import torch
from jaxtyping import Int
from torch import Tensor

from vlens.engine.checkpoint import Checkpoint
from vlens.engine.engine import Engine
from vlens.hooked.hook_registry import FwdHooks
from vlens.hooked.tokens import Input, is_texts
from vlens.runtime.vocabulary.steering import AnySteer

GenerateReturnType = Literal["input", "str", "tokens", "result"]
GENERATE_RETURN_TYPES: tuple[GenerateReturnType, ...] = ("input", "str", "tokens", "result")


@dataclass(frozen=True)
class Generation:
    """One finished request of :meth:`HookedVLLM.generate`."""

    prompt_tokens: list[int]
    tokens: list[int]  # the generated ones
    text: str  # the generated text
    finish_reason: str | None  # "length", "stop", ...


class GenerateMethods:
    """Mixed into :class:`~vlens.HookedVLLM`: ``generate`` over its checkpoint's planner, its
    engine and its hooks."""

    checkpoint: Checkpoint
    engine: Engine
    tokenizer: Any
    token_lists: Any
    _hooks_per_prompt: Any
    _padding_side: Any

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
        return_type: GenerateReturnType = "input",
        verbose: bool = True,
        seed: int | None = None,
        fwd_hooks: FwdHooks = (),
        prompt_hooks: Sequence[FwdHooks] | None = None,
        steering: Sequence[AnySteer] = (),
        prompt_steering: Sequence[Sequence[AnySteer]] | None = None,
    ) -> str | list[str] | Int[Tensor, "batch pos"] | list[list[int]] | list[Generation]:
        """Continue each prompt by up to ``max_new_tokens`` tokens, with hooks applied at prefill
        and at every decode step; TransformerLens's arguments and return types.

        ``fwd_hooks`` (and hooks added with :meth:`add_hook`) apply to every prompt;
        ``prompt_hooks[i]`` to prompt ``i`` only, so one batch can mix steered and plain prompts.
        ``steering`` (:class:`~vlens.runtime.vocabulary.steering.Steer` values) applies to every prompt and
        ``prompt_steering[i]`` to prompt ``i``: steering as data, which a compiled engine runs
        inside its graph (hook functions need an eager engine). Returns, as TransformerLens does,
        prompt + completion: text for text input and ``[batch, pos]`` token ids for a tensor
        (``return_type="input"``), or ``"str"`` / ``"tokens"`` explicitly (token-id lists in
        give token-id lists back); ``"result"`` gives each finished request as a
        :class:`Generation` (prompt and new token ids, new text, why it stopped).

        vLLM always decodes with its KV cache (``use_past_kv_cache=False`` gives the same
        tokens, slower in TransformerLens) and shows no progress bar (``verbose``). A prompt
        that ``max_new_tokens`` would take past the engine's ``max_model_len`` stops there,
        with a warning.
        """
        from vllm import SamplingParams

        check_max_new_tokens(max_new_tokens, least=1)
        check_generate_return_type(return_type)
        check_sampling(temperature, top_k, top_p)
        check_argument("freq_penalty", freq_penalty, _is_real, lambda p: p >= 0, "a number >= 0")
        prompts = self.token_lists(input, prepend_bos, padding_side, truncate=False)
        self._warn_if_cut_short(prompts, max_new_tokens)
        hooks, shared = self._hooks_per_prompt(
            fwd_hooks, prompt_hooks, len(prompts), max_new_tokens > 1
        )
        call = self.checkpoint.planner.call(
            len(prompts), [], hooks, shared, steering, prompt_steering,
            padding_side=self._padding_side(padding_side),
        )
        stops = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or [])
        temperature = float(temperature) if do_sample else 0.0
        params = [
            SamplingParams(
                max_tokens=int(max_new_tokens),
                temperature=temperature,
                top_p=1.0 if top_p is None else float(top_p),
                top_k=0 if top_k is None else int(top_k),
                seed=seed,
                ignore_eos=not stop_at_eos or bool(stops),
                stop_token_ids=stops if stop_at_eos else [],
                **frequency_penalty(freq_penalty, temperature, prompt),
            )
            for prompt in prompts
        ]
        run = self.engine.run(prompts, call.plans, params)
        if return_type == "result":
            return [
                Generation(prompt, new, self._text(new), reason)
                for prompt, new, reason in zip(prompts, run.sampled, run.finish_reasons)
            ]
        if return_type == "tokens" or (return_type == "input" and isinstance(input, Tensor)):
            finished = stops[0] if stops else self.tokenizer.eos_token_id
            return self._token_batch(prompts, run.sampled, padding_side, finished)
        sequences = [prompt + new for prompt, new in zip(prompts, run.sampled)]
        as_text = return_type == "str" or (
            return_type == "input" and (isinstance(input, str) or is_texts(input))
        )
        if not as_text:
            return sequences  # token lists in, token lists out
        texts = [self._text(sequence) for sequence in sequences]
        return texts[0] if len(texts) == 1 else texts

    def _token_batch(
        self, prompts: list[list[int]], sampled: list[list[int]],
        padding_side: Literal["left", "right"] | None, finished: int | None,
    ) -> Int[Tensor, "batch pos"]:
        """TransformerLens's ``[batch, pos]`` of prompt and new tokens: the prompts padded as
        ``to_tokens`` pads them, then each prompt's new tokens, a prompt that stopped early
        padded after its last token with the end-of-sequence token, as TransformerLens keeps
        sampling it for finished rows."""
        side = self._padding_side(padding_side)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        done = pad if finished is None else finished
        width, steps = max(map(len, prompts)), max(map(len, sampled))
        rows = []
        for prompt, new in zip(prompts, sampled):
            fill = [pad] * (width - len(prompt))
            head = fill + prompt if side == "left" else prompt + fill
            rows.append(head + new + [done] * (steps - len(new)))
        return torch.tensor(rows, dtype=torch.long)

    def _text(self, tokens: list[int]) -> str:
        """Generated text as TransformerLens returns it: special tokens (BOS) left out."""
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def _warn_if_cut_short(self, prompts: list[list[int]], max_new_tokens: int) -> None:
        """Warn, with the numbers, where ``max_new_tokens`` would take a prompt past the
        engine's ``max_model_len``: vLLM stops such a request there without a word (finish
        reason "length"). Prompts that do not fit at all are vLLM's own error."""
        max_model_len = self.engine.llm.model_config.max_model_len
        cut = [
            index
            for index, prompt in enumerate(prompts)
            if len(prompt) + max_new_tokens > max_model_len > len(prompt)
        ]
        if not cut:
            return
        longest = max(cut, key=lambda index: len(prompts[index]))
        length = len(prompts[longest])
        others = f" ({len(cut)} of {len(prompts)} prompts are cut short)" if len(cut) > 1 else ""
        warnings.warn(
            f"prompt {longest} has {length} tokens, and {length} + max_new_tokens="
            f"{max_new_tokens} is more than the engine's max_model_len={max_model_len}: vLLM "
            f"stops it after {max_model_len - length} new tokens{others}. For more, load the "
            f"model with a larger max_model_len (from_pretrained(..., max_model_len=...)).",
            stacklevel=3,
        )


def frequency_penalty(penalty: float, temperature: float, prompt: list[int]) -> dict[str, Any]:
    """TransformerLens's ``freq_penalty`` as vLLM's sampling parameters. TransformerLens
    subtracts ``penalty`` × (the token's count in the prompt and the tokens generated so far) from
    the logits after dividing them by the temperature, and not at all when greedy; vLLM applies
    its penalties and logit biases before the temperature, and its ``frequency_penalty`` counts
    generated tokens only. So: ``frequency_penalty = penalty · T`` for the generated tokens, and
    the prompt's counts as a fixed logit bias of ``-penalty · T · count``. (``penalty``: checked
    by the caller.)"""
    if not penalty or temperature == 0:
        return {}
    scaled = float(penalty) * temperature
    if scaled > 2:
        raise ValueError(
            f"freq_penalty={penalty} at temperature={temperature} is a penalty of {scaled:g} per "
            f"occurrence before the temperature, and vLLM takes at most 2 (its frequency_penalty "
            f"range): lower freq_penalty or the temperature so that their product is at most 2"
        )
    counts = Counter(prompt)
    return {"frequency_penalty": scaled,
            "logit_bias": {token: -scaled * count for token, count in counts.items()}}


def check_max_new_tokens(max_new_tokens: object, least: int) -> None:
    """``max_new_tokens`` is an int of at least ``least`` (``generate`` needs one new token:
    TransformerLens's fails on 0 too; ``run_with_cache`` takes 0 for the prompt alone)."""
    check_argument(
        "max_new_tokens", max_new_tokens, _is_int, lambda n: n >= least, f"an int >= {least}"
    )


def check_generate_return_type(return_type: object) -> None:
    if return_type not in GENERATE_RETURN_TYPES:
        choices = ", ".join(map(repr, GENERATE_RETURN_TYPES))
        raise ValueError(f"generate's return_type must be one of {choices}, not {return_type!r}")


def check_sampling(temperature: object, top_k: object, top_p: object) -> None:
    """TransformerLens's sampling arguments, checked before vLLM reads them (where a wrong type
    fails deep inside vLLM, and ``top_k=0`` would quietly mean every token)."""
    check_argument(
        "temperature", temperature, _is_real, lambda t: t >= 0, "a number >= 0 (0: greedy)"
    )
    if top_k is not None:
        check_argument(
            "top_k", top_k, _is_int, lambda k: k >= 1, "None (every token) or an int >= 1"
        )
    if top_p is not None:
        accepted = "None (every token) or a number in (0, 1]"
        check_argument("top_p", top_p, _is_real, lambda p: 0 < p <= 1, accepted)


def check_argument(
    name: str,
    value: object,
    kind: Callable[[object], bool],
    allowed: Callable[[Any], bool],
    accepted: str,
) -> None:
    """``TypeError`` where ``value`` is not of the ``kind`` wanted, ``ValueError`` where it is
    but is not ``allowed``; both say what is ``accepted``."""
    if not kind(value):
        raise TypeError(f"{name} must be {accepted}, not {value!r} ({type(value).__name__})")
    if not allowed(value):
        raise ValueError(f"{name} must be {accepted}, not {value!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)
