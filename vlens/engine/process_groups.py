"""vLLM's process-wide parallel groups, as several engines (and weightless trees) in one process
need them.

vLLM creates its expert-parallel group only when the process's first engine is a mixture of
experts: a MoE engine (or tree) built after a dense one fails with "expert parallel group is not
initialized". vlens adds the missing group, spanning the same ranks as the world group.
"""

from __future__ import annotations

import tempfile

import torch


def ensure_expert_group() -> None:
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized() or parallel_state._EP is not None:
        return
    world = parallel_state.get_world_group()
    # vLLM offers no public way to add one group to an initialised process.
    parallel_state._EP = parallel_state.init_model_parallel_group(
        [list(range(world.world_size))],
        world.local_rank,
        torch.distributed.get_backend(world.device_group),
        group_name="ep",
    )


def single_device_groups() -> None:
    """vLLM's parallel layers ask their process groups for sizes while being built: make sure
    one-device groups exist, expert-parallel included (an engine of a dense model, already
    running in this process, creates none, and MoE layers need one)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            distributed_init_method=f"file://{tempfile.mkdtemp()}/init",
            backend="gloo",
        )
        # Without a model config vLLM creates every group, the expert-parallel one included.
        with set_current_vllm_config(VllmConfig()):
            parallel_state.initialize_model_parallel(1, 1)
    ensure_expert_group()
