"""Shuffled batches of activations from a live model, for training an SAE without a store.

:func:`activation_batches` is what SAELens's ``SAETrainer`` takes as its ``data_provider``
(an iterator of ``[batch, d_in]`` tensors): prompts run through vLLM a chunk at a time, only
their real positions are kept, and rows pass through a shuffling buffer that mixes each fill with
half of the previous one, as SAELens's ``ActivationsStore`` mixes, so that a batch holds tokens of
many prompts rather than the consecutive tokens of a few.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator

import torch
from jaxtyping import Bool, Float
from torch import Tensor
from tqdm import tqdm

from vlens.hooked.model import HookedVLLM
from vlens.names.resolve import canonical
from vlens.store.saelens import per_token_width_problem

#: A prompt: text (tokenized by the model's tokenizer, as ``run_with_cache`` does) or token ids.
Prompt = str | list[int]


def activation_batches(
    model: HookedVLLM,
    prompts: Iterable[Prompt],
    hook_name: str,
    batch_size: int,
    *,
    buffer_batches: int = 16,
    seed: int = 0,
    prompts_per_call: int = 32,
    exclude_bos: bool = False,
    drop_last: bool = False,
    device: str | torch.device | None = None,
    progress: bool = False,
) -> Iterator[Float[Tensor, "batch d_in"]]:
    """Batches of ``batch_size`` activation rows of ``hook_name``, shuffled, one row per real
    token of ``prompts``: each token's row appears once over the iteration.

    ``prompts`` is consumed lazily, ``prompts_per_call`` at a time (one ``run_with_cache``
    call), so a generator of millions of prompts works. Rows fill a buffer of
    ``buffer_batches * batch_size`` rows; a full buffer is shuffled (a ``torch.Generator``
    seeded with ``seed``: the same prompts and seed give the same batches) and all but half of it
    is handed out in whole batches, the kept half mixing with the next fill. When the prompts end,
    what remains is shuffled and handed out, the last batch short unless ``drop_last``.

    ``d_in`` is the name's width per token: ``[pos, d]`` names give ``d``, ``[pos, head,
    d_head]`` names (``attn.hook_z``) ``head * d_head``, flattened as SAELens's hook_z SAEs read
    them. ``exclude_bos`` leaves out the rows whose token is the tokenizer's BOS token.
    ``device``: where the rows and batches are kept (``run_with_cache``'s ``device``; the CPU
    unless given). ``progress``: a tqdm bar of the tokens run. The batches are in the engine's
    dtype.

    A bad hook name or argument is refused here, before any prompt runs.
    """
    name = _row_name(model, hook_name)
    for argument, value in [("batch_size", batch_size), ("prompts_per_call", prompts_per_call)]:
        if value < 1:
            raise ValueError(f"{argument} must be positive, not {value}")
    if buffer_batches < 2:
        raise ValueError(
            f"buffer_batches must be at least 2, not {buffer_batches}: half the buffer stays "
            f"behind to mix with the next fill, and the other half must hold a whole batch"
        )
    bos = None
    if exclude_bos:
        bos = model.tokenizer.bos_token_id
        if bos is None:
            raise ValueError(
                "exclude_bos=True, but this model's tokenizer has no BOS token: leave "
                "exclude_bos off (no row is a BOS token's)"
            )
    rows = _token_rows(model, iter(prompts), name, prompts_per_call, bos, device, progress)
    return _mixed(rows, batch_size, buffer_batches * batch_size, seed, drop_last)


def _row_name(model: HookedVLLM, hook_name: str) -> str:
    """The canonical name of ``hook_name`` if it has one vector per token."""
    if any(char in hook_name for char in "*?["):
        raise ValueError(f"give one hook name, not a pattern ({hook_name!r})")
    name = canonical(hook_name, model.checkpoint.hook_specs, explain=model.checkpoint.explain)
    axes = model.checkpoint.hook_specs[name].shape.split()
    if axes[0] != "pos" or any(axis.endswith("pos") for axis in axes[1:]):
        raise ValueError(
            f"{name} is [batch {' '.join(axes)}], not one row per token ([batch pos ...]): "
            f"attention scores and patterns cannot train an SAE; pick a token-major name "
            f"(`vlens names MODEL` lists them with their shapes)"
        )
    problem = per_token_width_problem(name, axes[1:])
    if problem:
        raise ValueError(problem)
    return name


def _token_rows(
    model: HookedVLLM,
    prompts: Iterator[Prompt],
    name: str,
    per_call: int,
    bos: int | None,
    device: str | torch.device | None,
    progress: bool,
) -> Iterator[Float[Tensor, "rows d_in"]]:
    """Each call's rows of ``name`` at real positions (prompt after prompt), BOS rows left out
    when ``bos`` is given."""
    with tqdm(unit="token", unit_scale=True, disable=not progress) as bar:
        while chunk := list(itertools.islice(prompts, per_call)):
            token_lists = [
                model.token_lists(prompt if isinstance(prompt, str) else [prompt])[0]
                for prompt in chunk
            ]
            _, cache = model.run_with_cache(
                token_lists, names_filter=[name], return_type=None, device=device
            )
            value = cache[name]
            if not value.is_floating_point():
                raise ValueError(
                    f"{name} holds {value.dtype} values: an SAE trains on floating activations"
                )
            keep = _kept(cache.attention_mask, token_lists, bos).to(value.device)
            bar.update(int(cache.lengths.sum()))
            yield value[keep].flatten(1)


def _kept(
    real: Bool[Tensor, "batch pos"], token_lists: list[list[int]], bos: int | None
) -> Bool[Tensor, "batch pos"]:
    """The positions whose rows are kept: real ones, without BOS tokens where ``bos`` is set."""
    if bos is None:
        return real
    padded = torch.full(real.shape, -1, dtype=torch.long)
    for index, tokens in enumerate(token_lists):
        padded[index, : len(tokens)] = torch.tensor(tokens)
    return real & (padded != bos)


def _mixed(
    rows: Iterator[Float[Tensor, "rows d_in"]],
    batch_size: int,
    capacity: int,
    seed: int,
    drop_last: bool,
) -> Iterator[Float[Tensor, "batch d_in"]]:
    """Shuffled batches of ``rows``: each time ``capacity`` rows are buffered, shuffle them, hand
    out whole batches and keep ``capacity // 2`` rows (plus less than a batch) for the next fill;
    at the end, shuffle and hand out the rest."""
    generator = torch.Generator().manual_seed(seed)

    def shuffled(parts: list[Tensor]) -> Tensor:
        buffer = torch.cat(parts)
        order = torch.randperm(buffer.shape[0], generator=generator)
        return buffer[order.to(buffer.device)]

    buffered: list[Tensor] = []
    count = 0
    for new in rows:
        buffered.append(new)
        count += new.shape[0]
        if count < capacity:
            continue
        buffer = shuffled(buffered)
        served = (count - capacity // 2) // batch_size * batch_size
        yield from buffer[:served].split(batch_size)
        buffered, count = [buffer[served:]], count - served
    if count:
        batches = shuffled(buffered).split(batch_size)
        if drop_last and batches[-1].shape[0] < batch_size:
            batches = batches[:-1]
        yield from batches
