"""DeepSpeed 0.19.8: the patches msds applies to it and the private attributes msds reads.

- pipelines: the process groups a PipelineModule builds (reused across engines), its grid's rank
  lists, the range of layer specs this stage holds, and deciding on the optimizer step that
  `train_batch` takes inside;
- ZeRO optimizers: the torch optimizer inside DeepSpeed's wrapper, the flat tensors its state is
  keyed by, re-linking ZeRO-1/2's per-parameter views of that state (a 0.19.8 bug), and which
  parameters ZeRO manages;
- engines: what ZeRO 3 keeps of a destroyed engine in module globals;
- checkpoints: the non-tensor types DeepSpeed pickles into them (the allowlist of msds's safe
  loading), routing `load_checkpoint`'s reads through a safe loader (0.19.8 unpickles with
  weights_only=False), and recording which files `save_checkpoint` wrote on this rank;
- JIT-built ops: one extension cache per Python environment, built with that environment's ninja,
  and a build whose builder was killed recovered instead of waited on forever.
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import sys
import time
from pathlib import Path

import deepspeed.comm as ds_comm
import torch
import torch.distributed as dist
from deepspeed.ops.op_builder.builder import OpBuilder

from msds import startup

# Process groups of the pipeline layouts built so far, by (world group, rank set).
_GROUPS: dict[tuple, object] = {}


@contextlib.contextmanager
def reused_process_groups():
    """Within it, `deepspeed.comm.new_group` returns the group built earlier for the same ranks
    (of the same world group) instead of a new one.

    Why: every engine of a run (one per V-cycle phase) builds a PipelineModule with the same layout,
    and DeepSpeed's PipelineParallelGrid opens a new set of communicators for each (NCCL ones hold
    GPU memory) that nothing closes. Remove when DeepSpeed reuses or frees them itself:
    tests/test_compat.py::test_pipeline_grids_share_groups_only_with_reuse shows whether two
    PipelineModules still get different groups without it."""
    create = ds_comm.new_group

    def new_group(ranks):
        key = (id(dist.group.WORLD), tuple(sorted(ranks)))
        if key not in _GROUPS:
            _GROUPS[key] = create(ranks=ranks)
        return _GROUPS[key]

    ds_comm.new_group = new_group
    try:
        yield
    finally:
        ds_comm.new_group = create


def reused_group_count() -> int:
    """How many process groups reused_process_groups() holds: constant across a run's engines when
    the reuse works (tests/dist/train_checks.py checks it over pipeline runs)."""
    return len(_GROUPS)


def pipeline_group_ranks(module) -> tuple[list[int], list[int]]:
    """The global ranks of this process's data-parallel and pipeline groups, as the
    PipelineModule's grid (private `_grid`) built them.

    Why: msds checks that DeepSpeed's pipeline topology and megatron-core's parallel state agree.
    Replace when DeepSpeed exposes the rank lists; tests/test_compat.py::
    test_pipeline_accessors_read_a_real_pipeline_module fails when the attributes move."""
    return module._grid.dp_group, module._grid.pp_group


def local_layer_indices(module) -> range:
    """Indices of the layer specs this pipeline stage holds (private `_local_start` / `_local_stop`).

    Why: msds names each stage's parameters after the flat model and checks how many blocks a stage
    holds. Replace when DeepSpeed exposes the bounds; tests/test_compat.py::
    test_pipeline_accessors_read_a_real_pipeline_module fails when the attributes move."""
    return range(module._local_start, module._local_stop)


@contextlib.contextmanager
def pipeline_step_decided(engine, apply, skipped):
    """Within it, a PipelineEngine's optimizer step (which `train_batch` runs after the last
    backward pass) first asks `apply(loss)` whether to make the update, and runs inside `skipped(engine)`
    when not. `loss` is this rank's share of the batch's loss: on the last stage the mean over its
    micro-batches (private `total_loss`, the sum `train_batch` averages afterwards) times the number
    of stages, elsewhere 0, so that its sum over every rank divided by the world size is the mean
    over the data-parallel replicas, as for a flat model (msds.train.guards.StepGuard).

    Why: the pipeline engine applies the update inside `train_batch` (its schedule's OptimizerStep,
    which the private `_INSTRUCTION_MAP` runs as `_exec_optimizer_step`), before the caller sees the
    loss, so a bad step could not be skipped. tests/test_compat.py::
    test_the_pipeline_engine_runs_its_optimizer_step_from_the_instruction_map fails when the
    attributes move; tests/test_faults.py::test_pipeline_skips_bad_steps shows the skip."""
    from deepspeed.runtime.pipe.schedule import OptimizerStep

    step = type(engine)._INSTRUCTION_MAP[OptimizerStep]

    def decided(self, *args, **kwargs):
        if self.is_last_stage():
            loss = self.total_loss / self.gradient_accumulation_steps() * self.num_stages
        else:
            loss = torch.zeros((), device=self.device)
        with contextlib.nullcontext() if apply(loss) else skipped(self):
            return step(self, *args, **kwargs)

    engine._INSTRUCTION_MAP = {**type(engine)._INSTRUCTION_MAP, OptimizerStep: decided}
    try:
        yield
    finally:
        del engine._INSTRUCTION_MAP


def base_optimizer(engine) -> torch.optim.Optimizer:
    """The torch optimizer that holds the Adam state: the one inside DeepSpeed's ZeRO / mixed
    precision wrapper (its `optimizer` attribute), or the engine's optimizer itself (ZeRO-0, fp32).

    Why: transitions read and write the moments and step counts there. tests/test_compat.py::
    test_zero1_links_later_groups_moments_only_with_the_relink uses it on a real ZeRO-1 engine."""
    optimizer = engine.optimizer
    return getattr(optimizer, "optimizer", optimizer)


def optimizer_state_flats(engine) -> list[torch.Tensor]:
    """The fp32 tensors the base optimizer keys its state by: the params of its param groups, plus
    ZeRO-3's partitioned flat sub-groups (private `fp32_partitioned_groups_flat`), which ZeRO-3 puts
    into the param groups only while it steps them.

    Why: a fresh engine that is to receive mapped moments needs AdamW's state created before its
    first step (msds.train.engine). tests/test_compat.py::
    test_optimizer_state_flats_are_what_adamw_keeps_state_for checks them on a real ZeRO-1 engine."""
    base = base_optimizer(engine)
    flats = [flat for group in base.param_groups for flat in group["params"]]
    return flats + list(getattr(engine.optimizer, "fp32_partitioned_groups_flat", []))


def relink_hp_optimizer_states(engine) -> None:
    """(Re)build ZeRO-1/2's per-parameter views of the optimizer state (what
    `deepspeed.utils.safe_get_full_optimizer_state` reads); nothing for other ZeRO stages.

    Why: DeepSpeed 0.19.8 links them once, right after the *first* parameter group's first step
    (`_optimizer_step` -> `_lazy_init_hp_params_optimizer_state`, then `_hp_optimizer_states_linked`
    stays True), when later groups' state is still empty: parameters of later groups (msds's
    no-weight-decay group) then have no moments to read (safe_get_full_optimizer_state raises
    "exp_avg not found in optimizer state fragment"). Clearing the flag and calling it again links
    every group. Remove when tests/test_compat.py::
    test_zero1_links_later_groups_moments_only_with_the_relink finds the second group's moments
    without it."""
    optimizer = engine.optimizer
    if hasattr(optimizer, "_lazy_init_hp_params_optimizer_state"):
        optimizer._hp_optimizer_states_linked = False
        optimizer._lazy_init_hp_params_optimizer_state()


def is_zero_managed(param) -> bool:
    """Whether DeepSpeed's ZeRO owns this parameter's optimizer state: ZeRO-3 tags parameters with
    `ds_id`, ZeRO-1/2 attach the private `_hp_mapping` (the link to their fp32 fragment).

    Why: such a parameter's moments are written through `safe_set_full_optimizer_state`; the
    others (ZeRO-0 in fp32) directly in the torch optimizer's state. Replace when DeepSpeed offers a
    public test; tests/test_compat.py::test_zero_managed_parameters fails when the tags move."""
    return hasattr(param, "ds_id") or hasattr(param, "_hp_mapping")


def release_zero3_references(module) -> None:
    """Drop what ZeRO 3 keeps of a destroyed engine in module globals, which
    `DeepSpeedEngine.destroy` leaves: its top module on the forward stack
    (`deepspeed.runtime.zero.parameter_offload.FWD_MODULE_STACK`, pushed when the engine is built),
    and the unbounded `functools.lru_cache` of
    `PartitionedParameterCoordinator.__params_to_release`, keyed by the coordinator and the
    engine's submodules (cleared whole: msds has one engine at a time).

    Why: through either, the module, its hooks and so the engine, its optimizer and every partition
    stayed alive: each engine a transition replaced was kept for the rest of the run (at one
    process, about 950 MiB per V-cycle for the 43M-parameter model of
    benchmarks/transition_memory.py). Remove when DeepSpeed's destroy releases them;
    tests/test_transition.py::test_a_destroyed_engine_is_freed fails while anything keeps them."""
    from deepspeed.runtime.zero import parameter_offload
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

    stack = parameter_offload.FWD_MODULE_STACK
    stack[:] = [m for m in stack if m is not module]
    # The method is the lru_cache wrapped once more (instrument_w_nvtx, which keeps no __wrapped__).
    method = PartitionedParameterCoordinator._PartitionedParameterCoordinator__params_to_release
    for cell in method.__closure__ or ():
        if hasattr(cell.cell_contents, "cache_clear"):
            cell.cell_contents.cache_clear()


def full_shape(param) -> torch.Size:
    """A parameter's shape, also when a model built under `deepspeed.zero.Init` holds only this
    rank's partition of it (its `.shape` is then empty; ZeRO-3 keeps the real one in `ds_shape`).

    Why: msds sorts parameters into weight-decay groups by their dimensions, and a transition under
    ZeRO 3 builds the new model partitioned (msds.train.engine.build_engine). Replace when DeepSpeed
    exposes the shape publicly; tests/test_transition.py::
    test_streamed_transitions_install_the_whole_model_operators fails (decay groups differ) when the
    attribute moves."""
    return getattr(param, "ds_shape", param.shape)


def checkpoint_types() -> list[type]:
    """The classes, other than tensors and plain containers, that DeepSpeed 0.19.8 pickles into the
    checkpoint files msds resumes from and converts: ZeRO's stage enum and parameter fragment
    addresses, and the loss scaler (the static one in fp32 and bf16 runs, the dynamic one in fp16
    runs), all in `*optim_states.pt`. Records of numbers: rebuilding them runs no code of the file.

    Why: msds reads checkpoints with torch.load(weights_only=True), which refuses every class it is
    not given. Found by listing torch.serialization.get_unsafe_globals_in_checkpoint over real
    checkpoints (ZeRO 0-3; fp32, bf16, fp16; TP=2, PP=2, random-LTD). tests/test_compat.py::
    test_deepspeed_checkpoints_hold_exactly_the_listed_types fails when DeepSpeed stores another
    class, or no longer one of these (then drop it)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [ZeroStageEnum, fragment_address, LossScaler, DynamicLossScaler]


@contextlib.contextmanager
def checkpoint_reads_through(engine, load):
    """Within it, every file `engine.load_checkpoint` reads (module, optimizer, ZeRO partitions,
    pipeline layers) is read by `load(path, map_location)` instead of by the engine's checkpoint
    engine (its `load` method is replaced on that one instance, and put back on the way out).

    Why: DeepSpeed 0.19.8's TorchCheckpointEngine.load calls torch.load(weights_only=False), so a
    crafted checkpoint runs code when resumed; load_checkpoint offers no option to change that, and
    reads every file of a ZeRO 0-3, tensor- or pipeline-parallel checkpoint through that method.
    Remove when tests/test_compat.py::test_deepspeed_checkpoint_engine_runs_a_pickles_code finds
    that DeepSpeed's own checkpoint engine refuses a pickle that calls a function."""
    checkpoint_engine = engine.checkpoint_engine
    checkpoint_engine.load = lambda path, map_location=None: load(path, map_location=map_location)
    try:
        yield
    finally:
        del checkpoint_engine.load          # the class's method shows through again


@contextlib.contextmanager
def checkpoint_writes_recorded(engine):
    """Within it, every file the engine's checkpoint engine writes (module, optimizer, ZeRO
    partitions, pipeline layers: all `save_checkpoint` writes into the tag's directory) is appended,
    once written, to the list it yields (its `save` method is wrapped on that one instance, and put
    back on the way out). DeepSpeed's default checkpoint engine writes synchronously (torch.save):
    a file in the list is complete.

    Why: msds hashes each checkpoint file on the rank that wrote it (msds.train.checkpointing.save),
    and DeepSpeed 0.19.8 does not say which files a rank wrote. Replace when it does;
    tests/test_compat.py::test_recorded_checkpoint_writes_are_the_tags_files fails when
    save_checkpoint writes a file into the tag's directory past the checkpoint engine (rank 0 then
    hashes it for the manifest anyway)."""
    checkpoint_engine = engine.checkpoint_engine
    save = checkpoint_engine.save
    written: list[Path] = []

    def recorded(state_dict, path):
        save(state_dict, path)
        written.append(Path(path))

    checkpoint_engine.save = recorded
    try:
        yield written
    finally:
        del checkpoint_engine.save          # the class's method shows through again


def fewer_syncs_and_launches(engine) -> None:
    """Four patches of a ZeRO-1/2 engine's optimizer (not under fp16, nor with CPU offload or MoE):
    its gradient norm read by no host, as fewer operations, the model's views of the flat weight
    buffer re-pointed only when they moved, and no reduction of gradients over a data-parallel group
    of one rank. The same values as DeepSpeed's.

    - `scaled_global_norm`: each group's norm from `torch._foreach_norm` over its gradients (one
      launch where DeepSpeed makes three per gradient), summed, all-reduced and combined as DeepSpeed
      does (an invalid norm becomes inf, on the device).
    - the invalid-norm test: DeepSpeed's `step` and `unscale_and_clip_grads` read the norm on the host
      (`is_invalid_grad_norm`: a sync per step each, in fp32 and in bf16 whatever
      `check_grad_overflow` says). For the norm of the first patch they do not: clipping by an inf norm
      is what DeepSpeed does after reading it, and a step on non-finite gradients is skipped by msds's
      loop, which reads the loss's finiteness (the one read per step it makes anyway). fp16 keeps
      DeepSpeed's test: its loss scaler needs the overflow flag.
    - `_update_model_bit16_weights` (re-points every parameter at its slice of the flat buffer after
      each step, four operations per parameter, marked "we probably don't need this?" in DeepSpeed):
      skipped when every parameter already is that slice, as after each step.
    - `buffered_reduce_fallback` (the reduction of a gradient bucket with
      `zero_optimization.contiguous_gradients: false`: the bucket flattened, divided by the group's
      size, all-reduced, and each gradient copied back from it, five operations per parameter):
      skipped when the data-parallel group has one rank, no sequence parallelism and the gradients
      are in the communication dtype, where it leaves every gradient as it was (a division by 1.0
      and a sum over one rank are exact).

    Why: issue 59; benchmarks/host_overhead.py counts the operations and syncs per step with and
    without. Remove when DeepSpeed norms over foreach or the flat buffer, reads no value and skips a
    one-rank reduction; tests/test_compat.py::test_fewer_syncs_patch_keeps_deepspeeds_values checks
    the values (with and without contiguous gradients), and
    test_the_one_rank_reduction_patch_skips_the_bucket_reduction the skipped all-reduce."""
    from deepspeed.runtime.zero import stage_1_and_2 as zero

    optimizer = engine.optimizer
    if (not isinstance(optimizer, zero.DeepSpeedZeroOptimizer) or optimizer.dtype == torch.float16
            or optimizer.cpu_offload or optimizer.has_moe_layers):
        return
    _install_unread_norm_test(zero)
    optimizer.scaled_global_norm = lambda norm_type=2: _foreach_scaled_global_norm(optimizer, norm_type)
    update = optimizer._update_model_bit16_weights
    optimizer._update_model_bit16_weights = lambda group: None if _views_in_place(optimizer, group) else update(group)
    reduce = optimizer.buffered_reduce_fallback

    def buffered_reduce_fallback(rank, grads, communication_data_type, *args, **kwargs):
        if _reduction_is_identity(zero, optimizer, grads, communication_data_type):
            return None
        return reduce(rank, grads, communication_data_type, *args, **kwargs)

    optimizer.buffered_reduce_fallback = buffered_reduce_fallback


def _reduction_is_identity(zero, optimizer, grads, communication_data_type) -> bool:
    """Whether DeepSpeed's bucket reduction would leave `grads` unchanged: one rank, no sequence
    parallelism (its divisor), no cast to another dtype and back, no correctness-test mode."""
    return (dist.get_world_size(group=optimizer.dp_process_group) == 1 and optimizer.sequence_parallel_size == 1
            and not zero.pg_correctness_test and all(g.dtype == communication_data_type for g in grads))


def _install_unread_norm_test(zero) -> None:
    if getattr(zero.is_invalid_grad_norm, "msds_patched", False):
        return
    original = zero.is_invalid_grad_norm

    def is_invalid_grad_norm(norm):
        return False if getattr(norm, "msds_unread", False) else original(norm)

    is_invalid_grad_norm.msds_patched = True
    zero.is_invalid_grad_norm = is_invalid_grad_norm


def _foreach_scaled_global_norm(optimizer, norm_type=2):
    from deepspeed.runtime.constants import PIPE_REPLICATED
    from deepspeed.runtime.utils import combine_grad_norm_groups, is_model_parallel_parameter
    from deepspeed.runtime.zero.utils import get_norm_dtype

    assert norm_type == 2, "only L2 norm supported"
    norms = []
    for i in range(len(optimizer.bit16_groups)):
        grads = [g for g in optimizer.averaged_gradients[i] if not getattr(g, "_zero_padding", False)]
        grads = [g for g, p in zip(grads, optimizer.params_in_partition[i])
                 if not getattr(p, PIPE_REPLICATED, False)
                 and (is_model_parallel_parameter(p) or optimizer.model_parallel_rank == 0)]
        # dtype: each norm accumulated in DeepSpeed's norm dtype, no cast of each gradient launched
        total = (torch.stack(torch._foreach_norm(grads, norm_type, dtype=get_norm_dtype())).pow(norm_type).sum().float()
                 if grads
                 else torch.zeros((), dtype=torch.float32, device=optimizer.device))
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=optimizer.dp_process_group)
        optimizer._model_parallel_all_reduce(tensor=total, op=dist.ReduceOp.SUM)
        norms.append(total.pow(1.0 / norm_type))
    norm = combine_grad_norm_groups(norms, norm_type=norm_type)
    norm.msds_unread = True
    return norm


def _views_in_place(optimizer, group: int) -> bool:
    """Whether every parameter of `group` already is its slice of the flat buffer (host pointers only)."""
    flat = optimizer.bit16_groups_flat[group]
    base, size = flat.data_ptr(), flat.element_size()
    slices = zip(optimizer.round_robin_bit16_groups[group], optimizer.round_robin_bit16_meta[group],
                 optimizer.round_robin_bit16_offsets[group])
    if not all(p.data_ptr() == base + offset * size and p.shape == meta.shape for p, meta, offset in slices):
        return False
    order = optimizer.round_robin_bit16_indices[group]
    robin = optimizer.round_robin_bit16_groups[group]
    return all(p.data_ptr() == robin[order[k]].data_ptr() for k, p in enumerate(optimizer.bit16_groups[group]))


# -- JIT-built ops ---------------------------------------------------------------------------------

EXTENSIONS_DIR = "TORCH_EXTENSIONS_DIR"


def extension_cache() -> Path:
    """Where torch builds DeepSpeed's JIT ops: TORCH_EXTENSIONS_DIR (set by use_one_extension_cache)."""
    return Path(os.environ[EXTENSIONS_DIR])


def use_one_extension_cache() -> None:
    """One cache of DeepSpeed's JIT-built C++ ops per Python environment, built by one ninja, and no
    start that waits on a dead builder's lock.

    - TORCH_EXTENSIONS_DIR, unless already set, becomes `<sys.prefix>/torch-extensions` (torch's
      default, the user's cache directory, is shared by every environment on the machine);
    - this environment's bin/ goes first on PATH when it holds a ninja (the `ninja` package's):
      torch runs `ninja` from PATH, and two ninja versions (the environment's and the system's,
      chosen by whichever PATH a launcher or job had) each read the other's build log as stale and
      rebuild the op, under the cache's lock each time (issue 66);
    - OpBuilder.jit_load runs under `_build_lock` and removes a stale lock file first.

    Why: torch.utils.cpp_extension's FileBaton is a bare `lock` file in the op's build directory,
    created at every start (the build step runs, a no-op when built) and removed when it ends; a
    process killed in between leaves it, and every later start waits on it forever (issue 66).
    tests/test_compat.py::test_torchs_build_lock_outlives_its_process fails the day torch's lock
    dies with its process; tests/test_startup.py::test_a_killed_builds_leftovers_do_not_block_the_next_run
    plants that leftover under real launches."""
    os.environ.setdefault(EXTENSIONS_DIR, str(Path(sys.prefix) / "torch-extensions"))
    env_bin = Path(sys.prefix) / "bin"
    path = os.environ.get("PATH", "").split(os.pathsep)
    if (env_bin / "ninja").exists() and path[0] != str(env_bin):
        os.environ["PATH"] = os.pathsep.join([str(env_bin), *path])
    if not getattr(OpBuilder.jit_load, "msds_recovers", False):
        OpBuilder.jit_load = _recovering(OpBuilder.jit_load)


def _recovering(jit_load):
    @functools.wraps(jit_load)
    def load(self, *args, **kwargs):
        build_dir = extension_cache() / self.name
        with startup.waiting_on(lambda: _build_wait(self.name, build_dir)), _build_lock(build_dir):
            _remove_if_stale(build_dir / "lock")
            return jit_load(self, *args, **kwargs)

    load.msds_recovers = True
    return load


@contextlib.contextmanager
def _build_lock(build_dir: Path):
    """An flock on `<build dir>/msds.lock` around a JIT load: one msds process of the machine builds
    or loads an op at a time, and the kernel releases the lock when its holder dies, however."""
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "msds.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _remove_if_stale(lock: Path) -> None:
    """Under _build_lock a FileBaton `lock` file is another process's only while that process keeps
    it open (torch holds it open from creation to removal): one that no process of this machine has
    open was left by a killed builder. ninja finishes the build it interrupted (its log vouches only
    for outputs whose command completed), so the lock file is all there is to remove."""
    if lock.exists() and not _holders(lock):
        print(f"msds: removing {lock}, left by a killed build of a DeepSpeed op (no process holds it)",
              file=sys.stderr, flush=True)
        lock.unlink(missing_ok=True)


def _holders(path: Path) -> list[int]:
    """The processes of this machine that have `path` open (from /proc; those this user can read)."""
    target, pids = str(path.resolve()), []
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        with contextlib.suppress(OSError):
            if any(os.readlink(fd) == target for fd in fd_dir.iterdir()):
                pids.append(int(fd_dir.parent.name))
    return pids


def _build_wait(name: str, build_dir: Path) -> str:
    """What a JIT load waits on, for the start-up watchdog: the lock file and its age, or the build."""
    lock = build_dir / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return f"the JIT build or load of DeepSpeed's op {name} in {build_dir} (or msds.lock there, held by another process)"
    holders = _holders(lock)
    held = f"held open by process {', '.join(map(str, holders))}" if holders else "held by no process"
    return f"the lock file {lock} (age {age:.0f} s, {held}) of DeepSpeed's JIT-built op {name}"
