"""Prompts as token ids, and token ids as text: the tokenizer side of TransformerLens's model.

Strings are tokenized by TransformerLens's rule, so that a notebook's position-indexed results
(``cache["resid_post", 3][0, 5]``, ``get_token_position``) mean the same token in vlens as in
TransformerLens:

* ``prepend_bos`` (``None``: ``cfg.default_prepend_bos``) says whether the sequence starts with
  the BOS token, whatever the checkpoint's tokenizer does by itself. TransformerLens 4.3
  defaults to ``True`` except for the architectures whose adapter says otherwise (the Qwen
  family, Phi, GPT-NeoX, ...: :data:`vlens.hooked.config.NO_BOS_ARCHITECTURES`). A tokenizer that
  adds BOS itself has it taken off for ``prepend_bos=False``; one that doesn't gets the BOS
  *text* put in front of the string (when it is one token), as TransformerLens does.
* batches are padded with the tokenizer's pad token (its EOS where it has none) on
  ``padding_side`` (``None``: ``tokenizer.padding_side``, which :func:`prepare_tokenizer` sets to
  ``cfg.default_padding_side``);
* strings longer than ``cfg.n_ctx`` tokens are cut to ``n_ctx`` (``truncate=True``), the BOS
  counted in, before a tokenizer-added BOS is taken off.

There is no ``prepend_bos="tokenizer"``: TransformerLens's ``prepend_bos`` is a bool, and the
checkpoint's own rule is one of the two (``prepend_bos=False`` for chat-template text, which
already carries its special tokens). The per-model default is ``cfg.default_prepend_bos``, set
when the model is loaded, as TransformerLens's ``from_pretrained(default_prepend_bos=...)``.
Token ids (lists, tensors, arrays) are never changed: what you pass is what the model runs.
Anything that is not a prompt (:data:`PROMPT_FORMS`) is refused, naming what was given.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Literal, TypeGuard

import numpy as np
import torch
from jaxtyping import Int
from torch import Tensor
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from vlens.hooked.config import PADDING_SIDES, ModelConfig, PaddingSide, tokenizer_bos_eos

Input = str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]] | Tensor | np.ndarray
#: What every prompt-taking method accepts, for error messages.
PROMPT_FORMS = (
    "a str, a list of str, or token ids: an integer tensor or array of shape [pos] or "
    "[batch, pos], a list of ints, or a list of lists of ints"
)
EMPTY_INPUT = f"input is empty: give {PROMPT_FORMS}"


class NotOneTokenError(ValueError, AssertionError):
    """A string that is not exactly one token. Both a ``ValueError`` (what vlens raised before)
    and an ``AssertionError`` (what TransformerLens's ``to_single_token`` raises)."""


def prepare_tokenizer(
    tokenizer: PreTrainedTokenizerBase, padding_side: PaddingSide | None = None
) -> PreTrainedTokenizerBase:
    """The checkpoint's tokenizer set up as TransformerLens sets up ``model.tokenizer``:

    * reloaded with ``add_bos_token=True`` where it has a BOS token it does not add (so that
      ``model.tokenizer(text)`` starts with BOS, as in TransformerLens; a tokenizer that cannot
      be rebuilt that way is kept as it is);
    * ``padding_side`` (None: the tokenizer's own, "right" if it has none);
    * a pad token (its EOS) and a BOS token (its EOS) where it has none.

    The token methods give TransformerLens's ids with this tokenizer; with the checkpoint's
    tokenizer as loaded they give the same ids for byte-level BPE tokenizers (GPT-2, Llama 3,
    Qwen, SmolLM2), but may differ for SentencePiece ones, whose first word tokenizes
    differently after a BOS written as text.
    """
    if padding_side not in (None, *PADDING_SIDES):
        raise ValueError(f"padding_side must be 'left', 'right' or None, not {padding_side!r}")
    prepared = tokenizer
    if tokenizer.bos_token is not None and not _adds_bos_token(tokenizer):
        kwargs = copy.deepcopy(tokenizer.init_kwargs)
        source = kwargs.pop("name_or_path", None) or tokenizer.name_or_path
        kwargs.pop("add_bos_token", None)
        try:
            prepared = AutoTokenizer.from_pretrained(source, add_bos_token=True, **kwargs)
        except (ValueError, OSError):
            # e.g. a BOS whose text the tokenizers library's template cannot express; such a
            # tokenizer gets the BOS text in front of each string instead.
            prepared = copy.deepcopy(tokenizer)
        prepared.padding_side = tokenizer.padding_side
    else:
        prepared = copy.deepcopy(tokenizer)
    if padding_side is not None:
        prepared.padding_side = padding_side
    if prepared.padding_side is None:
        prepared.padding_side = "right"
    if prepared.pad_token is None and prepared.eos_token is not None:
        prepared.pad_token = prepared.eos_token
    if prepared.bos_token is None and prepared.eos_token is not None:
        prepared.bos_token = prepared.eos_token
    return prepared


def _adds_bos_token(tokenizer: PreTrainedTokenizerBase) -> bool:
    configured = tokenizer.init_kwargs.get("add_bos_token")
    return bool(getattr(tokenizer, "add_bos_token", False) if configured is None else configured)


class TokenMethods:
    """TransformerLens's token methods over a HuggingFace tokenizer (``self.tokenizer``) and
    ``self.cfg`` (``d_vocab``, ``n_ctx``, ``default_prepend_bos``, ``default_padding_side``,
    ``device``). See the module docstring for the tokenization rule."""

    tokenizer: PreTrainedTokenizerBase
    cfg: ModelConfig

    # ---- strings -> ids ----------------------------------------------------------------------

    def token_lists(
        self,
        input: Input,
        prepend_bos: bool | None = None,
        padding_side: PaddingSide | None = None,
        truncate: bool = True,
    ) -> list[list[int]]:
        """Each prompt of ``input`` as token ids, unpadded: strings by TransformerLens's rule
        (see :meth:`to_tokens`), token ids (lists, tensors, arrays) unchanged. ``padding_side``
        is checked but changes no row (only where :meth:`to_tokens` puts its padding).
        Raises ``ValueError`` for an empty input, a prompt without tokens and ids outside the
        vocabulary, and ``TypeError`` / ``ValueError`` for what is not a prompt (a dict, bytes,
        bools, floats, a 3-D tensor, ...: :data:`PROMPT_FORMS` says what is): each row is what
        the engine will run."""
        self._padding_side(padding_side)
        rows = self._rows(input, prepend_bos, padding_side, truncate)
        for index, row in enumerate(rows):
            if not row:
                raise ValueError(f"prompt {index} has no tokens")
        return rows

    def to_tokens(
        self,
        input: Input,
        prepend_bos: bool | None = None,
        padding_side: PaddingSide | None = None,
        move_to_device: bool = True,
        truncate: bool = True,
    ) -> Int[Tensor, "batch pos"]:
        """Token ids as ``[batch, pos]``, as TransformerLens's ``to_tokens``.

        ``prepend_bos`` (None: ``cfg.default_prepend_bos``): whether each string starts with
        BOS. Pass ``prepend_bos=False`` when tokenizing part of a prompt.
        ``padding_side`` (None: ``tokenizer.padding_side``, i.e. ``cfg.default_padding_side``):
        where strings of different lengths are padded, with the tokenizer's pad token.
        ``truncate``: cut strings to ``cfg.n_ctx`` tokens. ``move_to_device``: put the tokens on
        ``cfg.device``. Beyond TransformerLens, token ids (lists of ids, tensors) are accepted
        too and returned unchanged, padded where rows differ in length.
        """
        side = self._padding_side(padding_side)
        rows = self._rows(input, prepend_bos, side, truncate)
        longest = max((len(row) for row in rows), default=0)
        pad = self._pad_id()
        fill = [[pad] * (longest - len(row)) for row in rows]
        padded = [row + f if side == "right" else f + row for row, f in zip(rows, fill)]
        tokens = torch.tensor(padded, dtype=torch.long).reshape(len(rows), longest)
        return tokens.to(self.cfg.device) if move_to_device else tokens

    def to_single_token(self, string: str) -> int:
        """The id of ``string``, which must be exactly one token (tokenized without BOS);
        otherwise :class:`NotOneTokenError`, a ``ValueError`` and an ``AssertionError``."""
        ids = self._encode([string], prepend_bos=False, padding_side=None, truncate=True)[0]
        if len(ids) != 1:
            raise NotOneTokenError(f"{string!r} is {len(ids)} tokens, not one: {ids}")
        return ids[0]

    def get_token_position(
        self,
        single_token: str | int | Tensor,
        input: str | Tensor | Sequence[int] | np.ndarray,
        mode: Literal["first", "last"] = "first",
        prepend_bos: bool | None = None,
        padding_side: PaddingSide | None = None,
    ) -> int:
        """The position of ``single_token`` (an id, or a string that is one token) in ``input``
        (a string, tokenized as :meth:`to_tokens` does, or token ids: 1-D, or ``[1, pos]``), its
        first or last occurrence by ``mode``. Errors as TransformerLens's: ``AssertionError``
        for a token that does not occur and for a batch of more than one row, ``ValueError``
        for another ``mode``."""
        if isinstance(input, str):
            tokens = self.to_tokens(input, prepend_bos, padding_side, move_to_device=False)
        else:
            tokens = input if isinstance(input, Tensor) else torch.as_tensor(np.asarray(input))
        if tokens.dim() == 2:
            if tokens.shape[0] != 1:
                raise AssertionError(
                    f"If tokens are rank two, they must have shape [1, seq_len], not {tokens.shape}"
                )
            tokens = tokens[0]
        if isinstance(single_token, str):
            single_token = self.to_single_token(single_token)
        elif isinstance(single_token, Tensor):
            single_token = int(single_token.item())
        found = torch.nonzero(tokens == single_token).flatten()
        if len(found) == 0:
            raise AssertionError("The token does not occur in the prompt")
        if mode == "first":
            return int(found[0])
        if mode == "last":
            return int(found[-1])
        raise ValueError(f"mode must be 'first' or 'last', not {mode}")

    # ---- ids -> strings ----------------------------------------------------------------------

    def to_str_tokens(
        self,
        input: Input,
        prepend_bos: bool | None = None,
        padding_side: PaddingSide | None = None,
    ) -> list[str] | list[list[str]]:
        """Each token as its text, as TransformerLens's ``to_str_tokens``: a string (tokenized
        as :meth:`to_tokens` does) or one sequence of ids (1-D tensor or array, or ``[1, pos]``)
        gives a list of str; a list of strings or of sequences gives one list per item.
        ``prepend_bos`` and ``padding_side`` apply to strings only. Beyond TransformerLens, a
        list of ids is one sequence (TransformerLens raises ``ValueError`` for it)."""
        if isinstance(input, (list, tuple)):
            if input and all(_is_id(item) for item in input):
                return self._decode_each([int(item) for item in input])
            return [
                self.to_str_tokens(item, prepend_bos, padding_side)  # type: ignore[misc]
                for item in input
            ]
        if isinstance(input, str):
            return self._decode_each(self._encode([input], prepend_bos, padding_side, True)[0])
        if isinstance(input, (Tensor, np.ndarray)):
            squeezed = input.squeeze()
            if squeezed.ndim > 1:
                raise AssertionError(
                    f"Invalid tokens input to to_str_tokens, has shape: {squeezed.shape}"
                )
            ids = squeezed.tolist()
            return self._decode_each(ids if isinstance(ids, list) else [ids])
        raise ValueError(
            f"to_str_tokens takes a str, token ids (a tensor or array, a list of ints) or a list "
            f"of those, not {_describe(input)}"
        )

    def to_single_str_token(self, int_token: int) -> str:
        """The text of token ``int_token`` (a Python int: TransformerLens raises
        ``AssertionError`` for anything else, tensors and numpy integers included)."""
        if not isinstance(int_token, int):
            raise AssertionError(f"to_single_str_token takes an int, not {type(int_token)}")
        return self._decode_each([int_token])[0]

    def to_string(
        self, tokens: Sequence[int] | Sequence[Sequence[int]] | Tensor | np.ndarray
    ) -> str | list[str]:
        """Decode ids as TransformerLens's ``to_string``: one sequence (or one id) gives a
        str, a ``[batch, pos]`` batch a list of str; special tokens are kept and spaces are not
        cleaned up, so that the text is exactly the tokens'."""
        ids = tokens if isinstance(tokens, Tensor) else torch.tensor(tokens)
        if ids.dim() == 2:
            return self.tokenizer.batch_decode(ids.tolist(), clean_up_tokenization_spaces=False)
        if ids.dim() <= 1:
            return self.tokenizer.decode(ids.tolist(), clean_up_tokenization_spaces=False)
        raise ValueError(f"Invalid shape passed in: {ids.shape}")

    # ---- internals ---------------------------------------------------------------------------

    def _encode(
        self,
        texts: list[str],
        prepend_bos: bool | None,
        padding_side: PaddingSide | None,
        truncate: bool,
    ) -> list[list[int]]:
        """TransformerLens's rule, one unpadded row per text."""
        self._padding_side(padding_side)
        if isinstance(prepend_bos, str):  # e.g. "tokenizer": not a TransformerLens value
            raise TypeError(f"prepend_bos must be True, False or None, not {prepend_bos!r}")
        prepend = self.cfg.default_prepend_bos if prepend_bos is None else bool(prepend_bos)
        tokenizer = self.tokenizer
        adds_bos, adds_eos = tokenizer_bos_eos(tokenizer)
        bos_text = tokenizer.bos_token or tokenizer.eos_token
        if prepend and not adds_bos and bos_text is not None:
            # Only a BOS that is one token: any other would tokenize into pieces of its text.
            if len(tokenizer(bos_text, add_special_tokens=False)["input_ids"]) == 1:
                texts = [bos_text + text for text in texts]
        limits = {"truncation": True, "max_length": self.cfg.n_ctx} if truncate else {}
        rows = [list(row) for row in tokenizer(texts, **limits)["input_ids"]]
        eos = tokenizer.eos_token_id
        if adds_eos and eos is not None:
            for row in rows:  # the model should continue the text, not see it ended
                while len(row) > 1 and row[-1] == eos:
                    row.pop()
        leading = {tokenizer.bos_token_id, getattr(tokenizer, "cls_token_id", None)} - {None}
        if not prepend and adds_bos:
            rows = [row[1:] if row and row[0] in leading else row for row in rows]
        return rows

    def _rows(
        self,
        input: Input,
        prepend_bos: bool | None,
        padding_side: PaddingSide | None,
        truncate: bool,
    ) -> list[list[int]]:
        """Each prompt of ``input`` as token ids, unpadded: the one place where every
        prompt-taking method reads its input (and refuses what is not a prompt)."""
        if isinstance(input, str):
            return self._encode([input], prepend_bos, padding_side, truncate)
        if _is_text_batch(input):
            return self._encode(list(input), prepend_bos, padding_side, truncate)
        rows = _id_rows(input)
        d_vocab = self.cfg.d_vocab
        for index, row in enumerate(rows):
            if row and (max(row) >= d_vocab or min(row) < 0):
                raise ValueError(f"prompt {index} has a token id outside [0, {d_vocab})")
        return rows

    def _padding_side(self, padding_side: PaddingSide | None) -> PaddingSide:
        if padding_side is None:
            own = getattr(self.tokenizer, "padding_side", None)
            padding_side = own or self.cfg.default_padding_side
        if padding_side not in PADDING_SIDES:
            raise ValueError(f"padding_side must be 'left' or 'right', not {padding_side!r}")
        return padding_side  # type: ignore[return-value]

    def _pad_id(self) -> int:
        for candidate in (self.tokenizer.pad_token_id, self.tokenizer.eos_token_id):
            if candidate is not None:
                return candidate
        return 0

    def _decode_each(self, ids: list[int]) -> list[str]:
        singles = [[token] for token in ids]
        return self.tokenizer.batch_decode(singles, clean_up_tokenization_spaces=False)


def _is_text_batch(input: object) -> bool:
    if not _is_sequence(input):
        return False
    if len(input) == 0:
        raise ValueError(EMPTY_INPUT)
    return all(isinstance(item, str) for item in input)


def _id_rows(input: object) -> list[list[int]]:
    """Token-id input (a tensor or array of shape ``[pos]`` or ``[batch, pos]``, a list of ints,
    or a list of rows: lists of ints, 1-D tensors or arrays) as rows of Python ints.

    Anything else raises ``TypeError`` (a dict, bytes, bools, floats, a number, None, strings
    mixed with ids) or ``ValueError`` (an empty input, a tensor of another rank), naming what
    was given and what a prompt may be."""
    if isinstance(input, (Tensor, np.ndarray)):
        rows = _tensor_rows(input)
    elif not _is_sequence(input):
        raise TypeError(f"input is {_describe(input)}, not a prompt: give {PROMPT_FORMS}")
    elif all(_is_id(item) for item in input):
        rows = [[int(item) for item in input]] if input else []
    elif any(isinstance(item, str) for item in input):
        other = next(item for item in input if not isinstance(item, str))
        raise TypeError(
            f"input mixes strings with {_describe(other)}: a list of prompts is all strings "
            f"or all token ids; give {PROMPT_FORMS}"
        )
    else:
        rows = [_id_row(row, f"input[{index}]") for index, row in enumerate(input)]
    if not rows:
        raise ValueError(EMPTY_INPUT)
    return rows


def _tensor_rows(input: Tensor | np.ndarray) -> list[list[int]]:
    ids = _integer_tensor(input, "input")
    if ids.dim() not in (1, 2):
        raise ValueError(
            f"input is {_describe(input)}: token ids have shape [pos] or [batch, pos]; "
            f"give {PROMPT_FORMS}"
        )
    return ids.tolist() if ids.dim() == 2 else [ids.tolist()]


def _id_row(row: object, where: str) -> list[int]:
    """One prompt of a list of token-id prompts: a list of ints, or a 1-D tensor or array."""
    if isinstance(row, (Tensor, np.ndarray)):
        ids = _integer_tensor(row, where)
        if ids.dim() != 1:
            raise ValueError(
                f"{where} is {_describe(row)}: each prompt of a list is one sequence of ids, "
                f"[pos]; give {PROMPT_FORMS}"
            )
        return ids.tolist()
    if _is_sequence(row) and all(_is_id(item) for item in row):
        return [int(item) for item in row]
    raise TypeError(f"{where} is {_describe(row)}, not token ids: give {PROMPT_FORMS}")


def _integer_tensor(value: Tensor | np.ndarray, where: str) -> Tensor:
    """``value`` as a tensor, if its dtype holds token ids (integers, not bools)."""
    if isinstance(value, np.ndarray):
        integer = value.dtype.kind in "iu"
    else:
        integer = not (value.is_floating_point() or value.is_complex() or value.dtype == torch.bool)
    if not integer:
        raise TypeError(
            f"{where} is {_describe(value)}: token ids are integers (e.g. torch.long); "
            f"give {PROMPT_FORMS}"
        )
    return torch.from_numpy(value) if isinstance(value, np.ndarray) else value


def _is_id(item: object) -> bool:
    """A token id: a Python or numpy integer, not a bool (``True`` is an int to Python)."""
    return isinstance(item, (int, np.integer)) and not isinstance(item, bool)


def _is_sequence(value: object) -> TypeGuard[Sequence[object]]:
    """A list-like of prompts or ids: not a str, and not bytes (which iterate as ints)."""
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes, bytearray))


def _describe(value: object) -> str:
    """What was given, for an error message: the type, and for tensors the dtype and shape."""
    if isinstance(value, Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    if isinstance(value, np.ndarray):
        return f"a {value.dtype} array of shape {value.shape}"
    if isinstance(value, (bytes, bytearray)):
        return f"{type(value).__name__} (decode it to a str first)"
    if value is None or isinstance(value, bool):
        return repr(value)
    name = type(value).__name__
    article = "an" if name[0] in "aeiou" else "a"
    if _is_sequence(value):
        odd = next((item for item in value if not _is_id(item)), None)
        if odd is not None:
            return f"{article} {name} holding {_describe(odd)}"
    return f"{article} {name}"


def is_texts(input: Input) -> bool:
    """Whether ``input`` is a list of strings (so that results come back as text)."""
    return isinstance(input, (list, tuple)) and len(input) > 0 and isinstance(input[0], str)
