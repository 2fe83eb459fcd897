"""megatron-core 0.16.1 on machines without CUDA.

megatron-core assumes CUDA in a few corners that msds reaches (../shared/reference/STACK.md, section 5):
the model-parallel RNG tracker stores CUDA RNG states, and `GlobalMemoryBuffer` / RoPE /
dist_checkpointing ask for `torch.cuda.current_device()` or `torch.cuda.synchronize()`. This module
replaces exactly those with CPU equivalents. `install()` is applied only when CUDA is absent, and it
is pinned to megatron-core 0.16.1 internals: re-check it when the pin moves.
"""
from __future__ import annotations

import contextlib

import torch

_installed = False


def install() -> None:
    """Patch megatron-core for CPU use; a no-op when CUDA is available or already patched."""
    global _installed
    if _installed or torch.cuda.is_available():
        return
    import megatron.core.tensor_parallel.random as mp_random

    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *args, **kwargs: None
    mp_random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mp_random._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)

    class CPURNGStatesTracker(mp_random.CudaRNGStatesTracker):
        """The model-parallel RNG tracker with CPU generator states instead of CUDA ones."""

        def add(self, name, seed):
            generator = torch.Generator()
            generator.manual_seed(seed)
            self.states_[name] = generator.get_state()
            self.seeds_.add(seed)

        @contextlib.contextmanager
        def fork(self, name=mp_random._MODEL_PARALLEL_RNG_TRACKER_NAME):
            outside = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outside)

    mp_random.CudaRNGStatesTracker = CPURNGStatesTracker
    _installed = True


def seed_model_parallel_rng(seed: int) -> None:
    """Seed the model-parallel RNG tracker (a distinct stream per tensor-parallel rank), on CPU or GPU."""
    import megatron.core.tensor_parallel.random as mp_random
    from megatron.core import parallel_state

    if torch.cuda.is_available():
        mp_random.model_parallel_cuda_manual_seed(seed)
        return
    tracker = mp_random.CudaRNGStatesTracker()   # the CPU tracker once install() ran
    tracker.add(mp_random._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mp_random._MODEL_PARALLEL_RNG_TRACKER_NAME,
                seed + 2718 + parallel_state.get_tensor_model_parallel_rank())
    tracker.add(mp_random._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024)
    mp_random._CUDA_RNG_STATE_TRACKER = tracker
    mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
