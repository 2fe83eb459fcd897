"""megatron-core 0.16.1: its CUDA-only corners that msds reaches, made to work on a CPU.

megatron-core assumes CUDA in a few places msds uses: the model-parallel RNG tracker stores CUDA
generator states, and `GlobalMemoryBuffer`, RoPE and dist_checkpointing ask for
`torch.cuda.current_device()` or call `torch.cuda.synchronize()`. `install_cpu_fallbacks()`
replaces exactly those with CPU equivalents, and only when CUDA is absent (tests, CPU runs): on a
GPU nothing here patches anything. `seed_model_parallel_rng()` seeds the tracker on either.

megatron is imported inside the functions: importing this module costs nothing.
"""
from __future__ import annotations

import contextlib
import functools

import torch

_installed = False


def install_cpu_fallbacks() -> None:
    """Apply the three CPU fallbacks below; a no-op when CUDA is available or already applied.

    Why: msds builds megatron-core's tensor-parallel layers on machines without CUDA too, and
    megatron-core 0.16.1 has no CPU path for these corners. Whether each is still needed is tested
    one by one in tests/test_compat.py (see each function)."""
    global _installed
    if _installed or torch.cuda.is_available():
        return
    import megatron.core.tensor_parallel.random as mp_random

    tracker = cpu_rng_tracker_class()          # subclasses megatron's tracker: before replacing it
    patch_torch_cuda_queries()
    patch_cuda_rng_state_accessors()
    mp_random.CudaRNGStatesTracker = tracker
    _installed = True


def patch_torch_cuda_queries() -> None:
    """Make `torch.cuda.current_device()` return "cpu" and `torch.cuda.synchronize()` do nothing.

    Why: megatron-core's GlobalMemoryBuffer, RoPE and dist_checkpointing place tensors on
    `torch.cuda.current_device()` and synchronise, which a CPU-only torch refuses. Remove when
    tests/test_compat.py::test_megatron_needs_cuda_without_the_fallbacks finds that
    GlobalMemoryBuffer works on a CPU without it."""
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *args, **kwargs: None


def patch_cuda_rng_state_accessors() -> None:
    """Make megatron's private `_get_cuda_rng_state` / `_set_cuda_rng_state` read and write the CPU
    generator's state.

    Why: megatron code outside the tracker saves and restores "the CUDA RNG state" through them
    (activation recomputation's `_get_all_rng_states` / `_set_all_rng_states`, the tracker's
    conversions to graph-safe states). Remove together with the CPU tracker: the same
    subprocess test, tests/test_compat.py::test_megatron_needs_cuda_without_the_fallbacks, shows
    whether megatron's RNG code runs on a CPU by itself."""
    import megatron.core.tensor_parallel.random as mp_random

    mp_random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mp_random._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)


@functools.cache
def cpu_rng_tracker_class() -> type:
    """megatron's `CudaRNGStatesTracker` with CPU generator states instead of CUDA ones (one class
    per process). `install_cpu_fallbacks` puts it in the tracker's place, so megatron's
    `get_cuda_rng_tracker().fork()` (dropout, weight init in tensor-parallel regions) forks the CPU
    generator.

    Why: megatron-core 0.16.1's tracker calls torch.cuda.get_rng_state() in `add`, which fails
    without CUDA. tests/test_compat.py::test_cpu_rng_tracker_forks_and_restores checks that it
    works; ::test_megatron_needs_cuda_without_the_fallbacks shows whether megatron's own still fails."""
    import megatron.core.tensor_parallel.random as mp_random

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

    return CPURNGStatesTracker


def seed_model_parallel_rng(seed: int) -> None:
    """Seed the model-parallel RNG tracker (a distinct stream per tensor-parallel rank), on CPU or GPU.

    On a GPU this is megatron's public `model_parallel_cuda_manual_seed`. On a CPU that function
    also seeds CUDA, so the tracker is built here with megatron's seeds (data-parallel: seed,
    model-parallel: seed + 2718 + tensor-parallel rank, expert: seed + 1024) and installed through
    the private `_CUDA_RNG_STATE_TRACKER` globals. Remove the CPU branch with the CPU tracker
    (tests/test_compat.py::test_megatron_needs_cuda_without_the_fallbacks);
    ::test_seeded_tracker_streams checks the streams."""
    import megatron.core.tensor_parallel.random as mp_random
    from megatron.core import parallel_state

    if torch.cuda.is_available():
        mp_random.model_parallel_cuda_manual_seed(seed)
        return
    tracker = mp_random.CudaRNGStatesTracker()   # the CPU tracker once install_cpu_fallbacks() ran
    tracker.add(mp_random._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mp_random._MODEL_PARALLEL_RNG_TRACKER_NAME,
                seed + 2718 + parallel_state.get_tensor_model_parallel_rank())
    tracker.add(mp_random._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024)
    mp_random._CUDA_RNG_STATE_TRACKER = tracker
    mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
