"""SAEs in the compiled graph: feature edits as data, and top-k feature activations captured.

An SAE declared when the engine loads (``compiled_saes``) runs inside vLLM's traced forward at
the site of its ``hook_name``, on every row of every step, with no Python per request:

- **feature edits** (:class:`~vlens.runtime.vocabulary.steering.SAESteer`): the features requests edit sit
  in a table of ``slots`` columns (their encoder columns, biases, thresholds and decoder rows,
  copied in when a request first names a feature). Two ``[max_tokens, slots]`` buffers hold
  each row's ``f' = f·m + a`` terms, neutral (1, 0) where a row edits nothing. The graph
  computes the table's features ``f`` of every row (for ReLU, JumpReLU and gated SAEs from
  their columns only; a TopK SAE's choice needs the whole encode) and adds
  ``(f' − f)·W_dec``, undone through the input normalisation, to the activation: SAELens's
  output with its error term, where only the edit changes anything. Rows that edit nothing
  get exactly zero added.
- **top-k capture** (``top_k``): the whole encode of every row, after the edits, its ``top_k``
  largest features' values and indices copied into captured buffers as two names,
  ``{hook_name}.hook_sae_acts_post.top_k_values`` and ``.top_k_indices``.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from jaxtyping import Float, Int
from torch import Tensor, nn

from vlens.runtime.vocabulary.steering import SAESteer

if TYPE_CHECKING:  # a worker loads vlens.sae only where an SAE is compiled in (unpickled)
    from vlens.sae.autoencoder import SAE

#: The names of a compiled SAE's top-k capture, after its hook name.
TOP_K_VALUES = "hook_sae_acts_post.top_k_values"
TOP_K_INDICES = "hook_sae_acts_post.top_k_indices"


@dataclass(frozen=True, eq=False)
class CompiledSAE:
    """An SAE declared for the graph: called ``name`` by steers, reading ``hook`` (a canonical
    name), editing up to ``slots`` distinct features at once, capturing the ``top_k`` largest
    features per row (None: no capture)."""

    name: str
    hook: str
    sae: SAE
    slots: int
    top_k: int | None

    @property
    def target(self) -> str:
        """Its key in the worker's steering tables (:attr:`SAESteer.target`)."""
        return f"sae:{self.name}"

    @property
    def captured_names(self) -> tuple[str, ...]:
        if self.top_k is None:
            return ()
        return (f"{self.hook}.{TOP_K_VALUES}", f"{self.hook}.{TOP_K_INDICES}")


class SAEStage(nn.Module):
    """One compiled SAE in a worker: its weights on the device, the feature table, and the
    traced computation (:meth:`forward`)."""

    def __init__(self, compiled: CompiledSAE, device: torch.device) -> None:
        from vlens.sae import activations
        from vlens.sae.normalize import normalize

        super().__init__()
        self._normalize, self._gate, self._jump_relu = (
            normalize, activations.gate, activations.jump_relu)
        self.compiled = compiled
        self.sae = compiled.sae.to(device)
        cfg = self.sae.cfg
        self.whole_encode = compiled.top_k is not None or cfg.architecture == "topk"
        slots, dtype = compiled.slots, self.sae.dtype
        self.register_buffer("features", torch.zeros(slots, dtype=torch.long, device=device))
        self.register_buffer("w_enc", torch.zeros(cfg.d_in, slots, dtype=dtype, device=device))
        self.register_buffer("w_dec", torch.zeros(slots, cfg.d_in, dtype=dtype, device=device))
        #: the per-feature vectors of the architecture, by SAELens's weight name
        self.per_feature = [
            name for name in ("b_enc", "threshold", "b_gate", "b_mag", "r_mag")
            if getattr(self.sae, name) is not None
        ]
        for name in self.per_feature:
            self.register_buffer(f"{name}_sel", torch.zeros(slots, dtype=dtype, device=device))
        #: feature -> its slot; slot -> how many followed requests edit it
        self.slot_of: dict[int, int] = {}
        self.users = [0] * slots
        self.by_request: dict[str, list[int]] = defaultdict(list)

    # ---- the table (between steps) -----------------------------------------------------------

    def terms(self, tag: str, steer: SAESteer) -> tuple[Tensor, Tensor]:
        """Request ``tag``'s ``(m, a)`` over the table's slots (neutral at slots it does not
        edit), its features placed in the table first."""
        m, a = steer.multipliers_and_offsets()
        multiplier = torch.ones(self.compiled.slots)
        offset = torch.zeros(self.compiled.slots)
        for feature, m_f, a_f in zip(steer.features, m, a):
            slot = self._place(int(feature), steer)
            self.users[slot] += 1
            self.by_request[tag].append(slot)
            multiplier[slot], offset[slot] = m_f, a_f
        return multiplier, offset

    def release(self, tag: str) -> None:
        """Request ``tag`` is finished: the slots only it used are free again."""
        for slot in self.by_request.pop(tag, ()):
            self.users[slot] -= 1

    def _place(self, feature: int, steer: SAESteer) -> int:
        slot = self.slot_of.get(feature)
        if slot is not None:
            return slot
        free = next((s for s, users in enumerate(self.users) if users == 0), None)
        if free is None:
            raise RuntimeError(
                f"{steer.target}: the requests being served edit more than "
                f"{self.compiled.slots} distinct features of this SAE at once; load the model "
                f"with a larger compiled_sae_slots"
            )
        self.slot_of = {f: s for f, s in self.slot_of.items() if s != free}
        self.slot_of[feature] = free
        sae = self.sae
        with torch.no_grad():
            self.features[free : free + 1].fill_(feature)  # a kernel, no copy from the host
            self.w_enc[:, free] = sae.W_enc[:, feature]
            decoder = sae.W_dec[feature]
            if sae.cfg.architecture == "topk" and sae.cfg.rescale_acts_by_decoder_norm:
                decoder = decoder / decoder.norm()
            self.w_dec[free] = decoder
            for name in self.per_feature:
                getattr(self, f"{name}_sel")[free] = getattr(sae, name)[feature]
        return free

    # ---- inside the graph --------------------------------------------------------------------

    def forward(
        self, x: Tensor, multiplier: Float[Tensor, "rows slots"], offset: Float[Tensor, "rows slots"]
    ) -> tuple[Tensor, Float[Tensor, "rows d_sae"] | None]:
        """``x`` (``[rows, ...]``, the name's value) with the rows' feature edits, and, where the
        whole encode runs, every feature of every row after the edits."""
        sae, cfg = self.sae, self.sae.cfg
        flat = x.reshape(x.shape[0], -1).to(sae.dtype)  # a hook_z SAE reads the heads flattened
        normed, restore = self._normalize(flat, cfg.normalize_activations, cfg.d_in)
        if cfg.apply_b_dec_to_input:
            normed = normed - sae.b_dec
        every: Tensor | None = None
        if self.whole_encode:
            every = sae._activation(*sae._pre_activations(normed))
            chosen = every.gather(1, self.features.expand(x.shape[0], -1))
        else:
            chosen = self._chosen_features(normed)
        multiplier, offset = multiplier.to(sae.dtype), offset.to(sae.dtype)
        change = chosen * multiplier + offset - chosen
        touched = ((multiplier != 1) | (offset != 0)).any(dim=-1, keepdim=True)
        delta = restore.linear(change @ self.w_dec)
        delta = torch.where(touched, delta, torch.zeros_like(delta))
        if every is not None:
            every = every.scatter_add(1, self.features.expand(x.shape[0], -1), change)
        return x + delta.reshape(x.shape).to(x.dtype), every

    def _chosen_features(self, normed: Float[Tensor, "rows d_in"]) -> Float[Tensor, "rows slots"]:
        """The table's features from their columns only (ReLU, JumpReLU, gated)."""
        architecture = self.sae.cfg.architecture
        if architecture == "gated":
            gate_pre = normed @ self.w_enc + self.b_gate_sel
            magnitude_pre = normed @ (self.w_enc * self.r_mag_sel.exp()) + self.b_mag_sel
            return self._gate(gate_pre, magnitude_pre)
        pre = normed @ self.w_enc + self.b_enc_sel
        if architecture == "jumprelu":
            return self._jump_relu(pre, self.threshold_sel)
        return torch.relu(pre)


def top_k_of(
    every: Float[Tensor, "rows d_sae"], k: int
) -> tuple[Float[Tensor, "rows k"], Int[Tensor, "rows k"]]:
    """The ``k`` largest features of each row, largest first, and their indices (int32)."""
    values, indices = torch.topk(every, k=k, dim=-1, sorted=True)
    return values, indices.to(torch.int32)
