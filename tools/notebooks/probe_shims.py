"""A diagnostic stand-in: ``HookedVLLM`` with its first missing TransformerLens pieces filled in
crudely, so that the failures they hide come to light (backend ``vlens-probe``).

Not an implementation and not a result about vlens: every piece here is the least that lets a
notebook cell go on, written against TransformerLens 4.3's documented behaviour. Everything not
listed goes straight to the wrapped ``HookedVLLM``, and its caches are vlens's own (their
``model`` is the wrapped engine, so the cache's analysis methods meet vlens as it is).

Filled in: ``to_tokens(prepend_bos=, padding_side=)``, ``to_str_tokens``, ``to_string`` of an
int or a batch, ``model(...)`` with ``return_type="loss"``/``loss_per_token``, ``loss_fn``,
``run_with_cache(remove_batch_dim=, prepend_bos=)`` (``stop_at_layer=`` accepted and ignored:
the cache covers every layer), ``run_with_hooks`` with a
loss, ``get_token_position``, ``cfg.device`` / ``cfg.default_prepend_bos``, ``unembed.W_U`` /
``unembed.b_U`` / ``embed.W_E``, and ``set_use_attn_result`` (a no-op: vlens derives
``hook_result`` when asked).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor
from transformer_lens.utilities.lm_utils import lm_cross_entropy_loss


def _is_text(input: Any) -> bool:
    return isinstance(input, str) or (
        isinstance(input, (list, tuple)) and bool(input) and all(isinstance(x, str) for x in input)
    )


class ProbeModel:
    """``HookedVLLM`` plus the crude pieces listed in the module docstring."""

    def __init__(self, model: Any) -> None:
        self._model = model
        fields = {name: getattr(model.cfg, name) for name in model.cfg.__dataclass_fields__}
        self.cfg = SimpleNamespace(**fields, device=torch.device("cpu"), default_prepend_bos=True)
        self.unembed = SimpleNamespace(W_U=model.W_U, b_U=model.b_U)
        embedding = next(
            name for name in model.checkpoint.weights.file_of if "embed_tokens" in name or "wte" in name
        )
        self.embed = SimpleNamespace(W_E=model.checkpoint.weights[embedding])

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    # ---- tokens --------------------------------------------------------------------------------

    def to_tokens(
        self,
        input: str | list[str],
        prepend_bos: bool | None = None,
        padding_side: str | None = None,
        move_to_device: bool = True,
        truncate: bool = True,
    ) -> Tensor:
        tokenizer = self._model.tokenizer
        texts = [input] if isinstance(input, str) else list(input)
        rows = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
        if self.cfg.default_prepend_bos if prepend_bos is None else prepend_bos:
            rows = [[tokenizer.bos_token_id, *row] for row in rows]
        pad = (
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        )
        longest = max(len(row) for row in rows)
        side = padding_side or tokenizer.padding_side
        padded = [
            row + [pad] * (longest - len(row))
            if side == "right"
            else [pad] * (longest - len(row)) + row
            for row in rows
        ]
        return torch.tensor(padded)

    def to_str_tokens(
        self, input: Any, prepend_bos: bool | None = None, padding_side: str | None = None
    ) -> Any:
        if isinstance(input, list) and _is_text(input):
            return [self.to_str_tokens(item, prepend_bos, padding_side) for item in input]
        if isinstance(input, str):
            tokens = self.to_tokens(input, prepend_bos=prepend_bos, padding_side=padding_side)[0]
        else:
            tokens = torch.as_tensor(input).squeeze().reshape(-1)
        return self._model.tokenizer.batch_decode([[int(t)] for t in tokens.tolist()])

    def to_string(self, tokens: Any) -> str | list[str]:
        tokens = torch.as_tensor(tokens)
        if tokens.dim() == 2:
            return self._model.tokenizer.batch_decode(tokens, clean_up_tokenization_spaces=False)
        return self._model.tokenizer.decode(tokens.reshape(-1), clean_up_tokenization_spaces=False)

    def get_token_position(
        self,
        single_token: str | int,
        input: str | Tensor,
        mode: str = "first",
        prepend_bos: bool | None = None,
    ) -> int:
        tokens = self.to_tokens(input, prepend_bos=prepend_bos) if isinstance(input, str) else input
        tokens = tokens[0] if tokens.dim() == 2 else tokens
        token = (
            self.to_single_token(single_token)
            if isinstance(single_token, str)
            else int(single_token)
        )
        found = torch.arange(len(tokens))[tokens == token]
        assert len(found) > 0, "The token does not occur in the prompt"
        return int(found[0] if mode == "first" else found[-1])

    def _tokens(self, input: Any, prepend_bos: bool | None) -> Any:
        return self.to_tokens(input, prepend_bos=prepend_bos) if _is_text(input) else input

    # ---- running -------------------------------------------------------------------------------

    def loss_fn(
        self,
        logits: Tensor,
        tokens: Tensor,
        attention_mask: Tensor | None = None,
        per_token: bool = False,
    ) -> Tensor:
        return lm_cross_entropy_loss(logits, tokens.to(logits.device), attention_mask, per_token)

    def _finish(
        self, logits: Tensor | None, tokens: Any, return_type: str | None, per_token: bool
    ) -> Any:
        if return_type in ("loss", "both"):
            loss = self.loss_fn(logits, torch.as_tensor(tokens), per_token=per_token)
            return loss if return_type == "loss" else (logits, loss)
        return logits if return_type == "logits" else None

    def __call__(
        self,
        input: Any,
        return_type: str | None = "logits",
        loss_per_token: bool = False,
        prepend_bos: bool | None = None,
        **kwargs: Any,
    ) -> Any:
        tokens = self._tokens(input, prepend_bos)
        logits = self._model.run_with_hooks(tokens, return_type="logits" if return_type else None)
        return self._finish(logits, tokens, return_type, loss_per_token)

    forward = __call__

    def run_with_hooks(
        self,
        input: Any,
        fwd_hooks: Any = (),
        return_type: str | None = "logits",
        prepend_bos: bool | None = None,
        **kwargs: Any,
    ) -> Any:
        tokens = self._tokens(input, prepend_bos)
        per_token = kwargs.pop("loss_per_token", False)
        wants_logits = "logits" if return_type else None
        logits = self._model.run_with_hooks(
            tokens, fwd_hooks=fwd_hooks, return_type=wants_logits, **kwargs
        )
        return self._finish(logits, tokens, return_type, per_token)

    def run_with_cache(
        self,
        input: Any,
        names_filter: Any = None,
        return_type: str | None = "logits",
        remove_batch_dim: bool = False,
        stop_at_layer: int | None = None,
        prepend_bos: bool | None = None,
        **kwargs: Any,
    ) -> tuple[Any, Any]:
        tokens = self._tokens(input, prepend_bos)
        wants_logits = "logits" if return_type else None
        logits, cache = self._model.run_with_cache(
            tokens, names_filter=names_filter, return_type=wants_logits, **kwargs
        )
        if remove_batch_dim:
            cache.remove_batch_dim()
        return self._finish(logits, tokens, return_type, False), cache

    def set_use_attn_result(self, use_attn_result: bool) -> None:
        """vlens derives ``hook_result`` whenever it is asked for."""
