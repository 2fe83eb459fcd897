"""msds.compat: the version pins, and for each patch of a pinned library's private API a test that it
works and, where cheap, one that shows it is still needed (it fails the day the library no longer
needs the patch: then delete the patch). Also the package's import structure: `kernels` imports
nothing from msds, and no module imports itself back through others."""
import ast
import contextlib
import inspect
import json
import subprocess
import sys
from pathlib import Path

import deepspeed
import pytest
import torch
from deepspeed.pipe import LayerSpec, PipelineModule
from deepspeed.utils import safe_get_full_optimizer_state

import msds.compat as compat
from msds.compat import deepspeed_0_19 as ds_compat
from msds.compat import megatron_core_0_16 as megatron_compat
from msds.distributed import default_backend

REPO = Path(__file__).resolve().parents[1]
CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU fallbacks apply only without CUDA")


# --- version pins --------------------------------------------------------------------------------

def test_the_pinned_versions_are_installed():
    assert compat.version_mismatches() == []
    compat.check_versions()


def test_other_versions_are_refused_unless_allowed(monkeypatch):
    versions = {"deepspeed": "0.20.0", "megatron-core": None}
    monkeypatch.setattr(compat, "installed_version", versions.get)
    monkeypatch.delenv(compat.ALLOW_UNPINNED, raising=False)
    with pytest.raises(compat.VersionMismatch, match=r"deepspeed 0.20.0 is installed, msds needs 0.19.8; "
                                                     r"megatron-core is not installed, msds needs 0.16.1"):
        compat.check_versions()
    monkeypatch.setenv(compat.ALLOW_UNPINNED, "1")
    with pytest.warns(UserWarning, match=r"deepspeed 0.20.0 is installed"):
        compat.check_versions()


# --- megatron-core 0.16.1 ------------------------------------------------------------------------

_WITHOUT_FALLBACKS = """
import json, torch
import megatron.core.tensor_parallel.random as mp_random
from megatron.core.utils import GlobalMemoryBuffer
failures = {}
for name, attempt in (("rng_tracker_add", lambda: mp_random.CudaRNGStatesTracker().add("x", 1)),
                      ("global_memory_buffer", lambda: GlobalMemoryBuffer().get_tensor((2,), torch.float32, "x"))):
    try:
        attempt()
    except Exception as exc:
        failures[name] = f"{type(exc).__name__}: {exc}"
print(json.dumps(failures))
"""


@CPU_ONLY
def test_megatron_needs_cuda_without_the_fallbacks():
    """In a fresh process without install_cpu_fallbacks, megatron's RNG tracker and its global
    memory buffer still fail on a CPU. When one of them passes, megatron-core runs there by itself:
    delete the corresponding patch of msds.compat.megatron_core_0_16."""
    proc = subprocess.run([sys.executable, "-c", _WITHOUT_FALLBACKS], capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    failures = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "Torch not compiled with CUDA" in failures.get("rng_tracker_add", ""), \
        "megatron's RNG tracker now works on a CPU: drop cpu_rng_tracker_class and its accessors"
    assert "Torch not compiled with CUDA" in failures.get("global_memory_buffer", ""), \
        "megatron's GlobalMemoryBuffer now works on a CPU: drop patch_torch_cuda_queries"


@CPU_ONLY
def test_the_fallbacks_are_installed_and_work():
    """conftest's init_distributed installed them: megatron's tracker is the CPU one, and its memory
    buffer hands out CPU tensors."""
    import megatron.core.tensor_parallel.random as mp_random
    from megatron.core.utils import GlobalMemoryBuffer

    assert mp_random.CudaRNGStatesTracker is megatron_compat.cpu_rng_tracker_class()
    assert isinstance(mp_random.get_cuda_rng_tracker(), megatron_compat.cpu_rng_tracker_class())
    assert GlobalMemoryBuffer().get_tensor((2,), torch.float32, "x").device.type == "cpu"


def _draws(seed: int, n: int = 4) -> torch.Tensor:
    return torch.rand(n, generator=torch.Generator().manual_seed(seed))


@CPU_ONLY
def test_cpu_rng_tracker_forks_and_restores():
    """Inside fork(name) the CPU generator continues the named stream; outside it is untouched."""
    tracker = megatron_compat.cpu_rng_tracker_class()()
    tracker.add("stream", 7)
    outside = torch.get_rng_state()
    with tracker.fork("stream"):
        first = torch.rand(2)
    assert torch.equal(torch.get_rng_state(), outside)
    with tracker.fork("stream"):
        second = torch.rand(2)
    assert torch.equal(torch.cat([first, second]), _draws(7))
    assert torch.equal(torch.get_rng_state(), outside)


@CPU_ONLY
def test_seeded_tracker_streams():
    """seed_model_parallel_rng gives megatron's three streams their seeds (model-parallel: seed +
    2718 + the tensor-parallel rank, 0 here). The session's tracker is put back afterwards."""
    import megatron.core.tensor_parallel.random as mp_random

    session_tracker = mp_random._CUDA_RNG_STATE_TRACKER
    try:
        megatron_compat.seed_model_parallel_rng(99)
        tracker = mp_random.get_cuda_rng_tracker()
        for name, seed in ((mp_random._DATA_PARALLEL_RNG_TRACKER_NAME, 99),
                           (mp_random._MODEL_PARALLEL_RNG_TRACKER_NAME, 99 + 2718),
                           (mp_random._EXPERT_PARALLEL_RNG_TRACKER_NAME, 99 + 1024)):
            with tracker.fork(name):
                assert torch.equal(torch.rand(4), _draws(seed)), name
    finally:
        mp_random._CUDA_RNG_STATE_TRACKER = session_tracker


# --- DeepSpeed 0.19.8: pipelines -----------------------------------------------------------------

def _pipeline_module() -> PipelineModule:
    """A one-stage pipeline of two layers over the session's one-process world (deepspeed.comm
    wraps it, as deepspeed.initialize does before building an engine)."""
    deepspeed.init_distributed(dist_backend=default_backend(), dist_init_required=False)
    layers = [LayerSpec(torch.nn.Linear, 2, 2), LayerSpec(torch.nn.Linear, 2, 2)]
    return PipelineModule(layers=layers, num_stages=1)


def test_pipeline_grids_share_groups_only_with_reuse():
    """Two PipelineModules of one layout get new process groups from DeepSpeed, the same ones inside
    reused_process_groups(). When the first assertion fails DeepSpeed reuses them by itself: delete
    reused_process_groups."""
    first, second = _pipeline_module(), _pipeline_module()
    assert first.mpu().get_data_parallel_group() is not second.mpu().get_data_parallel_group()
    with ds_compat.reused_process_groups():
        first, second = _pipeline_module(), _pipeline_module()
    for group in ("get_data_parallel_group", "get_pipe_parallel_group"):
        assert getattr(first.mpu(), group)() is getattr(second.mpu(), group)(), group


def test_pipeline_accessors_read_a_real_pipeline_module():
    module = _pipeline_module()
    assert ds_compat.pipeline_group_ranks(module) == ([0], [0])
    assert ds_compat.local_layer_indices(module) == range(0, 2)


def test_the_pipeline_engine_runs_its_optimizer_step_from_the_instruction_map():
    """pipeline_step_decided replaces the OptimizerStep entry of the engine's (private)
    `_INSTRUCTION_MAP`, which `_exec_schedule` reads per instruction; the two-process use is
    tests/test_faults.py::test_pipeline_skips_bad_steps."""
    from deepspeed.runtime.pipe.engine import PipelineEngine
    from deepspeed.runtime.pipe.schedule import OptimizerStep

    assert PipelineEngine._INSTRUCTION_MAP[OptimizerStep] is PipelineEngine._exec_optimizer_step
    source = inspect.getsource(PipelineEngine._exec_schedule)
    assert "self._INSTRUCTION_MAP[type(cmd)]" in source, source


# --- torch 2.13 / DeepSpeed 0.19.8: JIT-built ops ---------------------------------------------------

def test_torchs_build_lock_outlives_its_process(tmp_path):
    """torch's FileBaton (the lock of every JIT build) is a bare file: one left by a SIGKILLed
    process still refuses the next builder, which would wait forever. When this fails the lock dies
    with its process: delete _remove_if_stale (use_one_extension_cache keeps the cache per
    environment)."""
    from torch.utils.file_baton import FileBaton

    lock = tmp_path / "lock"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from torch.utils.file_baton import "
                               "FileBaton; FileBaton(sys.argv[1]).try_acquire(); print(flush=True); time.sleep(60)",
                               str(lock)], stdout=subprocess.PIPE, text=True)
    holder.stdout.readline()
    holder.kill()
    holder.wait()
    assert not FileBaton(str(lock)).try_acquire()
    assert ds_compat._holders(lock) == []


def test_a_stale_build_lock_is_removed_and_a_held_one_kept(tmp_path, capsys):
    lock = tmp_path / "lock"
    with open(lock, "x"):
        ds_compat._remove_if_stale(lock)
        assert lock.exists()
    ds_compat._remove_if_stale(lock)
    assert not lock.exists()
    assert f"removing {lock}, left by a killed build" in capsys.readouterr().err


# --- DeepSpeed 0.19.8: ZeRO-1 optimizer state ----------------------------------------------------

def _zero1_engine_after_one_step():
    """A one-process ZeRO-1 engine over a Linear whose weight and bias are two parameter groups
    (msds's decay / no-decay split), after one optimizer step."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    groups = [{"params": [model.weight], "weight_decay": 0.01}, {"params": [model.bias], "weight_decay": 0.0}]
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
              "zero_optimization": {"stage": 1}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=config,
                                           dist_init_required=False)
    engine.backward(engine(torch.randn(2, 4)).sum())
    engine.step()
    return engine, model


def test_zero1_links_later_groups_moments_only_with_the_relink():
    """After the first step DeepSpeed 0.19.8 shows the first group's moments but not the second's;
    relink_hp_optimizer_states makes both read the optimizer's real state. When the
    pytest.raises fails DeepSpeed links every group itself: delete relink_hp_optimizer_states."""
    engine, model = _zero1_engine_after_one_step()
    try:
        base = ds_compat.base_optimizer(engine)
        assert isinstance(base, torch.optim.AdamW) and base is not engine.optimizer
        weight_flat, bias_flat = ds_compat.optimizer_state_flats(engine)
        real = {model.weight: base.state[weight_flat]["exp_avg"][:12].view(3, 4),
                model.bias: base.state[bias_flat]["exp_avg"][:3]}
        assert torch.equal(safe_get_full_optimizer_state(model.weight, "exp_avg"), real[model.weight])
        with pytest.raises(ValueError, match="exp_avg not found in optimizer state fragment"):
            safe_get_full_optimizer_state(model.bias, "exp_avg")
        ds_compat.relink_hp_optimizer_states(engine)
        for param, moment in real.items():
            assert moment.abs().sum() > 0
            assert torch.equal(safe_get_full_optimizer_state(param, "exp_avg"), moment)
    finally:
        engine.destroy()


def test_optimizer_state_flats_are_what_adamw_keeps_state_for():
    engine, _ = _zero1_engine_after_one_step()
    try:
        flats = ds_compat.optimizer_state_flats(engine)
        assert [id(t) for t in flats] == [id(t) for t in ds_compat.base_optimizer(engine).state]
    finally:
        engine.destroy()


def _zero1_clipped_run(patched: bool, precision: str, steps: int = 4, contiguous_gradients: bool = True):
    """Weights, gradient norms and host reads of a ZeRO-1 engine over two Linear layers (two parameter
    groups) whose gradients are clipped (norm well above 0.01), with or without
    fewer_syncs_and_launches."""
    from torch.utils._python_dispatch import TorchDispatchMode

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 3))
    weights = [p for p in model.parameters() if p.dim() == 2]
    groups = [{"params": weights, "weight_decay": 0.01},
              {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
              "gradient_clipping": 0.01, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
              "zero_optimization": {"stage": 1, "contiguous_gradients": contiguous_gradients},
              "bf16": {"enabled": precision == "bf16", "check_grad_overflow": False}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=config,
                                           dist_init_required=False)
    if patched:
        ds_compat.fewer_syncs_and_launches(engine)

    class Reads(TorchDispatchMode):
        """Host reads of a value, but of AdamW's step counters (host tensors on a GPU too)."""
        count, host = 0, set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Reads.count += func is torch.ops.aten._local_scalar_dense.default and id(args[0]) not in Reads.host
            return func(*args, **(kwargs or {}))

    norms = []
    try:
        g = torch.Generator().manual_seed(1)
        for step in range(steps):
            x = torch.randn(2, 4, generator=g).to(engine.device, next(model.parameters()).dtype)
            engine.backward(engine(x).float().pow(2).sum() * 100)
            with Reads() if step else contextlib.nullcontext():   # AdamW makes its counters at step 1
                engine.step()
            Reads.host = {id(state["step"]) for state in ds_compat.base_optimizer(engine).state.values()}
            norms.append(engine.get_global_grad_norm())
        return [p.detach().float().clone() for p in model.parameters()], norms, Reads.count
    finally:
        engine.destroy()


@pytest.mark.parametrize("contiguous", [True, False], ids=["contiguous", "not-contiguous"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_fewer_syncs_patch_keeps_deepspeeds_values(precision, contiguous):
    """The patched ZeRO-1 step gives DeepSpeed's weights and norms to the bit, with no host read of
    the norm (DeepSpeed reads it twice a step: `is_invalid_grad_norm` in `step` and in
    `unscale_and_clip_grads`); with `contiguous_gradients: false` (ds_configs/zero1.json) also
    without the one-rank bucket reduction."""
    ours, our_norms, our_reads = _zero1_clipped_run(True, precision, contiguous_gradients=contiguous)
    theirs, their_norms, their_reads = _zero1_clipped_run(False, precision, contiguous_gradients=contiguous)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    assert [float(n) for n in our_norms] == [float(n) for n in their_norms] and float(our_norms[0]) > 0.01
    assert their_reads >= 2 * 3 and our_reads == 0


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_zero1_without_contiguous_gradients_gives_the_same_weights(precision):
    """ds_configs/zero1.json's `contiguous_gradients: false` (no copy of each gradient into a bucket
    and again into the partition's buffer) steps to the same weights and norms as DeepSpeed's default,
    patched and not."""
    default, default_norms, _ = _zero1_clipped_run(False, precision, contiguous_gradients=True)
    for patched in (False, True):
        ours, our_norms, _ = _zero1_clipped_run(patched, precision, contiguous_gradients=False)
        assert all(torch.equal(a, b) for a, b in zip(ours, default))
        assert [float(n) for n in our_norms] == [float(n) for n in default_norms]


def test_the_one_rank_reduction_patch_skips_the_bucket_reduction():
    """With contiguous_gradients false, one rank and the patch, no gradient bucket is all-reduced."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class AllReduces(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            AllReduces.count += "allreduce" in str(func)
            return func(*args, **(kwargs or {}))

    counts = []
    for patched in (False, True):
        AllReduces.count = 0
        with AllReduces():
            _zero1_clipped_run(patched, "fp32", steps=2, contiguous_gradients=False)
        counts.append(AllReduces.count)
    # Unpatched: each step's bucket and the norm's all-reduce per group; patched: the norms only.
    assert counts[1] < counts[0], counts


def test_zero_managed_parameters():
    """ZeRO-1 tags its parameters (their moments go through safe_set_full_optimizer_state); a plain
    torch parameter is not tagged."""
    engine, model = _zero1_engine_after_one_step()
    try:
        assert ds_compat.is_zero_managed(model.weight) and ds_compat.is_zero_managed(model.bias)
        assert not ds_compat.is_zero_managed(torch.nn.Parameter(torch.zeros(2)))
    finally:
        engine.destroy()


# --- import structure ----------------------------------------------------------------------------

def _modules() -> dict[str, Path]:
    """Every module of the msds and kernels packages by dotted name (a package by its own name)."""
    out = {}
    for package in ("msds", "kernels"):
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imported(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The known modules `module` imports anywhere in its source (module level or inside functions).
    `from a import b` counts as importing a.b when that is a module, else a."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


def _import_graph() -> dict[str, set[str]]:
    known = _modules()
    return {module: _imported(module, path, known) for module, path in known.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph[node]):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_kernels_import_nothing_from_msds():
    graph = _import_graph()
    offending = {module: sorted(d for d in deps if d.split(".")[0] == "msds")
                 for module, deps in graph.items() if module.split(".")[0] == "kernels"}
    assert not any(offending.values()), offending


def test_no_import_cycles_among_msds_and_kernels_modules():
    """Edges are every import in a module's source, function-local ones included (an import inside a
    function only postpones a cycle). A package's own __init__ is not implied by importing one of its
    modules: re-exports from an __init__ are the usual Python pattern, not a cycle."""
    cycles = _cycles(_import_graph())
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_the_import_graph_sees_function_local_imports():
    graph = _import_graph()
    assert "msds.model.transformer" in graph["msds.model.pipeline"]
    assert "msds.compat.megatron_core_0_16" in graph["msds.distributed"]
    assert "kernels.multilevel" in graph["msds.multilevel.backends"]       # imported inside _kernels()
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_distributed_does_not_import_the_model_layer():
    assert not any(dep.startswith("msds.model") for dep in _import_graph()["msds.distributed"])



# --- DeepSpeed 0.19.8: loading checkpoints -------------------------------------------------------

class _TouchOnLoad:
    """Unpickling it creates `marker`: a stand-in for any code a crafted checkpoint could run."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _zero1_checkpoint(directory: Path, precision: str) -> Path:
    """The files of a real checkpoint of a one-process ZeRO-1 engine (fp32, bf16, or fp16 with
    dynamic loss scaling) over a Linear, after one step."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
              "zero_optimization": {"stage": 1}, "fp16": {"enabled": precision == "fp16", "loss_scale": 0},
              "bf16": {"enabled": precision == "bf16"}}
    dtype = {"fp32": torch.float, "bf16": torch.bfloat16, "fp16": torch.half}[precision]
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config,
                                           dist_init_required=False)
    try:
        engine.backward(engine(torch.randn(2, 4, dtype=dtype)).float().sum())
        engine.step()
        engine.save_checkpoint(str(directory), tag="t")
    finally:
        engine.destroy()
    return directory / "t"


def test_deepspeed_checkpoints_hold_exactly_the_listed_types(tmp_path):
    """Every class besides tensors and plain containers in real ZeRO-1 checkpoints (fp32, bf16 and,
    where the CPU runs fp16, fp16) is one of checkpoint_types(), and each of those occurs. When a
    type is missing from the list, resuming such checkpoints fails: add it (after checking that
    rebuilding it runs no code); when one no longer occurs, drop it. DeepSpeed refuses fp16 on a CPU
    without fp16 arithmetic (oneDNN's probe); there the fp16-only dynamic loss scaler is not looked
    for."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    fp16 = get_accelerator().is_fp16_supported()
    found = set()
    for precision in ("fp32", "bf16") + (("fp16",) if fp16 else ()):
        for path in _zero1_checkpoint(tmp_path / precision, precision).glob("*.pt"):
            found.update(torch.serialization.get_unsafe_globals_in_checkpoint(path))
    listed = [t for t in ds_compat.checkpoint_types() if fp16 or t is not DynamicLossScaler]
    assert found == {f"{t.__module__}.{t.__qualname__}" for t in listed}


def test_deepspeed_checkpoint_engine_runs_a_pickles_code(tmp_path):
    """DeepSpeed's checkpoint engine unpickles a file that calls a function (the call creates a
    file); inside checkpoint_reads_through(engine, safe_load) the same engine refuses it and nothing
    runs, and afterwards its own method is back. When the first assertion fails DeepSpeed loads
    safely by itself: delete checkpoint_reads_through."""
    from msds.errors import MsdsError
    from msds.train.checkpointing import safe_load

    marker, evil = tmp_path / "code-ran", tmp_path / "evil.pt"
    torch.save({"module": _TouchOnLoad(marker)}, evil)
    engine, _ = _zero1_engine_after_one_step()
    try:
        engine.checkpoint_engine.load(str(evil))
        assert marker.exists()
        marker.unlink()
        with ds_compat.checkpoint_reads_through(engine, safe_load):
            with pytest.raises(MsdsError, match=r"evil\.pt: refuses to unpickle getattr: not a tensor checkpoint"):
                engine.checkpoint_engine.load(str(evil), map_location="cpu")
        assert not marker.exists()
        assert "load" not in vars(engine.checkpoint_engine)
    finally:
        engine.destroy()


def test_recorded_checkpoint_writes_are_the_tags_files(tmp_path):
    """checkpoint_writes_recorded lists every file save_checkpoint writes into the tag's directory
    (ZeRO-1: the module file and this rank's optimizer partition), and afterwards the checkpoint
    engine's own method is back. When the sets differ, DeepSpeed writes past its checkpoint engine:
    rank 0 hashes such files alone (msds.train.checkpointing.save), so find what lists them."""
    engine, _ = _zero1_engine_after_one_step()
    try:
        with ds_compat.checkpoint_writes_recorded(engine) as written:
            engine.save_checkpoint(str(tmp_path), tag="t", save_latest=False)
        assert "save" not in vars(engine.checkpoint_engine)
    finally:
        engine.destroy()
    on_disk = {p.resolve() for p in (tmp_path / "t").rglob("*") if p.is_file()}
    assert len(on_disk) == 2 and {p.resolve() for p in written} == on_disk
