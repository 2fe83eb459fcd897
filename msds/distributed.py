"""Process groups: torch.distributed plus megatron-core's tensor/pipeline/data-parallel state.

msds models are built from megatron-core's parallel layers, which need megatron's parallel state
even at TP=1. A process started without a launcher (tools, tests, one-process runs) gets a
one-process gloo group, so that the same model code runs everywhere.
"""
from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from msds import startup
from msds.compat import check_versions, deepspeed_0_19, megatron_core_0_16


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def _launched() -> bool:
    """Whether a launcher (torchrun, the deepspeed launcher, slurm/train.sh) started this process."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def launched_world_size() -> int:
    """The number of processes of this job: the process group's once it exists, else the launcher's,
    else 1 (init_distributed then makes a one-process group)."""
    if dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ["WORLD_SIZE"]) if _launched() else 1


def init_distributed(tensor_parallel: int = 1, pipeline_parallel: int = 1, seed: int = 1234) -> None:
    """Initialise torch.distributed (from launcher variables, else one process) and megatron-core's
    parallel state. Idempotent for the same sizes. Refuses deepspeed / megatron-core versions other
    than msds.compat's pins: the compat patches it applies are written for those. DeepSpeed's
    JIT-built ops go to this environment's extension cache (msds.compat.deepspeed_0_19)."""
    check_versions()
    deepspeed_0_19.use_one_extension_cache()
    from megatron.core import parallel_state

    megatron_core_0_16.install_cpu_fallbacks()
    if not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        if _launched():
            import deepspeed

            rendezvous = (f"the rendezvous at {os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')} "
                          f"with the other {int(os.environ['WORLD_SIZE']) - 1} rank(s) (deepspeed.init_distributed)")
            with startup.waiting_on(rendezvous):
                deepspeed.init_distributed(dist_backend=default_backend(), timeout=timedelta(minutes=30))
        else:
            # One process: an in-memory store, no port to pick. DeepSpeed reads the launcher's
            # variables even then, so give it the one-process values. NCCL on a GPU as when launched:
            # a gloo group would send every CUDA collective (ZeRO's gradient reduction among them)
            # through host memory, about 24 ms of copies per BERT-Large step on an H100.
            for name in ("RANK", "LOCAL_RANK"):
                os.environ.setdefault(name, "0")
            os.environ.setdefault("WORLD_SIZE", "1")
            dist.init_process_group(default_backend(), store=dist.HashStore(), rank=0, world_size=1)
    if parallel_state.model_parallel_is_initialized():
        tp = parallel_state.get_tensor_model_parallel_world_size()
        pp = parallel_state.get_pipeline_model_parallel_world_size()
        if (tp, pp) == (tensor_parallel, pipeline_parallel):
            return
        parallel_state.destroy_model_parallel()
    # The sizes fit the world: msds.plan.build_plan checked them against launched_world_size().
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel,
                                             pipeline_model_parallel_size=pipeline_parallel)
    megatron_core_0_16.seed_model_parallel_rng(seed)


def seed_generators(seed: int) -> None:
    """Seed torch's generators and megatron-core's model-parallel tracker for a fresh run. A run
    started after another in the same process (`msds bench`, the test suites) must not inherit
    the tracker streams that run moved on (init_distributed seeds them only when it builds the
    parallel state)."""
    torch.manual_seed(seed)
    megatron_core_0_16.seed_model_parallel_rng(seed)


def data_parallel_group():
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_group()


class DeepSpeedMPU:
    """megatron-core's parallel state under the names DeepSpeed's `mpu` argument expects: for
    DeepSpeed the "model parallel" group is the tensor-parallel group, and ZeRO partitions over the
    data-parallel group."""

    @staticmethod
    def get_model_parallel_group():
        from megatron.core import parallel_state
        return parallel_state.get_tensor_model_parallel_group()

    @staticmethod
    def get_model_parallel_rank():
        from megatron.core import parallel_state
        return parallel_state.get_tensor_model_parallel_rank()

    @staticmethod
    def get_model_parallel_world_size():
        from megatron.core import parallel_state
        return parallel_state.get_tensor_model_parallel_world_size()

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size

    @staticmethod
    def get_tensor_model_parallel_src_rank():
        from megatron.core import parallel_state
        return parallel_state.get_tensor_model_parallel_src_rank()

    @staticmethod
    def get_data_parallel_group():
        return data_parallel_group()

    @staticmethod
    def get_data_parallel_rank():
        return dist.get_rank(data_parallel_group())

    @staticmethod
    def get_data_parallel_world_size():
        return dist.get_world_size(data_parallel_group())
