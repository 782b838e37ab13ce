"""The model a gradient twin is: TransformerLens's own, over HuggingFace, on the engine's checkpoint,
with no weight processing (the values vlens's names carry).

- TransformerLens 4: its ``TransformerBridge`` (``boot_transformers``, compatibility mode without
  processing): the model the parity suite compares every name against.
- TransformerLens 3 (SAELens's pin): ``HookedTransformer``, its weights converted from
  HuggingFace's unfolded and uncentred: the model SAELens's ``HookedSAETransformer`` is, so that
  an SAE feature's gradient is the one SAELens computes. TransformerLens 3 chooses a config
  converter from the words of a checkpoint's name before reading its ``config.json`` (a local
  folder whose path holds "llama" or "gemma" is never read), so the folder is handed to it
  through a link of a neutral name.

Both answer the same calls (``hooks``, ``add_hook``, ``run_with_cache``, ``set_use_*``); what
differs (where a hook point is registered, which names a switch gates) is here.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch

from vlens.names.tl_versions import HAS_BRIDGE

#: The switches that gate hook points, by the end of the names they gate (TransformerLens forms
#: those names only when switched on); the order in which they are tried.
GATES = (
    (("attn.hook_result",), "use_attn_result"),
    (("hook_q_input", "hook_k_input", "hook_v_input"), "use_split_qkv_input"),
    (("mlp_in",), "use_hook_mlp_in"),
    (("attn_in",), "use_attn_in"),
)


def build(path: Path, device: torch.device, dtype: torch.dtype) -> Any:
    """TransformerLens's model of the checkpoint at ``path`` on ``device``, in ``dtype``."""
    if HAS_BRIDGE:
        from transformer_lens.model_bridge import TransformerBridge

        twin = TransformerBridge.boot_transformers(str(path), device=str(device), dtype=dtype)
        twin.enable_compatibility_mode(no_processing=True)
    else:
        twin = hooked_transformer(path, device, dtype)
    twin.eval()
    return twin


def hooked_transformer(
    path: Path, device: torch.device, dtype: torch.dtype, model_class: type | None = None
) -> Any:
    """TransformerLens 3's ``HookedTransformer`` (or ``model_class``, a subclass of it such as
    SAELens's ``HookedSAETransformer``) on a local checkpoint, unprocessed."""
    from transformer_lens import HookedTransformer, loading
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="vlens-twin-") as folder:
        neutral = Path(folder) / "checkpoint"
        neutral.symlink_to(Path(path).resolve(), target_is_directory=True)
        try:
            cfg = loading.get_pretrained_model_config(str(neutral), device=str(device), dtype=dtype)
        except (NotImplementedError, AttributeError, KeyError) as error:
            raise NotImplementedError(
                f"TransformerLens 3's HookedTransformer (the gradient twin beside SAELens) does "
                f"not take this checkpoint's architecture ({type(error).__name__}: {error}); "
                f"run gradient work where vlens's default environment (TransformerLens 4, whose "
                f"bridge adapts it) is installed"
            ) from error
        hf = AutoModelForCausalLM.from_pretrained(neutral, dtype=dtype)
        state = loading.get_pretrained_state_dict(str(neutral), cfg, hf, dtype=dtype)
        del hf
        cfg.model_name = Path(path).name
        # the tokenizer is read again from its folder as the model is built
        twin = (model_class or HookedTransformer)(cfg, AutoTokenizer.from_pretrained(neutral),
                                                  move_to_device=False)
    twin.load_and_process_state_dict(state, fold_ln=False, center_writing_weights=False,
                                     center_unembed=False, fold_value_biases=False,
                                     refactor_factored_attn_matrices=False)
    twin.move_model_modules_to_device()
    return twin


def gated_reason(twin: Any, name: str) -> str | None:
    """The switch (``use_attn_in``, ...) that is off and keeps ``name`` from being formed, if
    any."""
    for ends, switch in GATES:
        if name.endswith(ends) and not getattr(twin.cfg, switch, False):
            return switch
    return None


def register_point(twin: Any, point: Any) -> None:
    """``point`` among the twin's hook points, under its name (an SAE's, while it is spliced)."""
    for registry in _registries(twin):
        registry[point.name] = point


def unregister_point(twin: Any, name: str) -> None:
    for registry in _registries(twin):
        registry.pop(name, None)


def _registries(twin: Any) -> list[dict[str, Any]]:
    """Where the twin finds its hook points by name: the bridge's one registry, or
    ``HookedTransformer``'s two (``add_hook`` reads ``mod_dict``, caches ``hook_dict``)."""
    return [twin._hook_registry] if HAS_BRIDGE else [twin.mod_dict, twin.hook_dict]
