"""The host's work per optimizer step, counted on the CPU (issue 59): operations dispatched, host-device
syncs and host time, for `msds train`'s real loop, a hand-written torch loop over msds's model and
Hugging Face's BertForMaskedLM, on BERT-Large's structure (24 layers) at a tiny width and batch, where
compute is negligible and what is left is the host's overhead. On a GPU every operation counted here
is a kernel launch and every sync drains the device's queue.

    .venv/bin/python benchmarks/host_overhead.py --json out.json [--steps 20] [--precision fp32 bf16]
        [--rows "msds train"]

Counting (`StepCounter`, used by tests/test_host_overhead.py too): a TorchDispatchMode counts every
ATen operation, and apart those that would launch a kernel on a GPU (not views, not allocations); syncs are the operations that read a device value on the host (aten._local_scalar_dense,
i.e. .item() / float() / bool() of a tensor; nonzero, is_nonzero, equal, masked_select, unique, boolean
indexing), copies from an accelerator to the host, `Tensor.tolist()`, and accelerator synchronize
calls (torch.cuda.synchronize and DeepSpeed's accelerator's). Each optimizer step closes a window:
`msds train`'s at the DeepSpeed engine's step that advances its global step (every line of the loop
between two such steps is in the window: logging, the loss's read, the next batch), the hand-written
loops' at their optimizer step. Figures are means over `--steps` windows after 3 warm-up steps; host
time comes from a second run without the counter (the window marks only). A dispatch mode counts its
own thread only: the batches `msds train` builds ahead in its loader's thread (`data.prefetch`) are
not in its count, those the hand-written loops build in their step are.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections import Counter
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
warnings.filterwarnings("ignore")

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
WARMUP = 3
aten = torch.ops.aten

# Operations whose result the host must wait for (their value or their output's shape).
SYNC_OPS = {aten._local_scalar_dense.default, aten.is_nonzero.default, aten.equal.default,
            aten.nonzero.default, aten.masked_select.default, aten._unique2.default, aten.unique_dim.default,
            aten.unique_consecutive.default, aten.repeat_interleave.Tensor}
# Operations that launch nothing on a GPU: allocations, and views (an output aliasing an input).
NO_KERNEL_OPS = {aten.empty.memory_format, aten.empty_like.default, aten.empty_strided.default, aten.lift_fresh.default,
                 aten._local_scalar_dense.default, aten.is_pinned.default, aten.set_.source_Tensor}
INDEX_OPS = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}


def _reads_device(func, args) -> bool:
    if func in SYNC_OPS:
        return True
    if func in INDEX_OPS:   # boolean indexing: the output's shape is the mask's count
        return any(t is not None and t.dtype == torch.bool for t in args[1])
    if func in (aten._to_copy.default, aten.copy_.default):
        source = args[1] if func is aten.copy_.default else args[0]
        return isinstance(source, torch.Tensor) and source.device.type != "cpu" and (
            args[0].device.type == "cpu" if func is aten.copy_.default else False)
    return False


class StepCounter(TorchDispatchMode):
    """Counts operations and syncs; `mark()` closes one optimizer step's window. With `count=False`
    only the window's host time is recorded (no dispatch mode)."""

    def __init__(self, count: bool = True):
        super().__init__()
        self.count = count
        self.ops = self.syncs = self.kernels = 0
        self.sync_names: Counter = Counter()
        self.windows: list[dict] = []
        self._last = None
        self.host_scalars: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        self.kernels += not (func.is_view or func in NO_KERNEL_OPS)
        if _reads_device(func, args) and id(args[0]) not in self.host_scalars:
            self._sync(str(func))
        return func(*args, **(kwargs or {}))

    def _sync(self, name: str) -> None:
        self.syncs += 1
        self.sync_names[name] += 1

    def note_host_scalars(self, optimizer: torch.optim.Optimizer) -> None:
        """Reads of this optimizer's step counters are no syncs: torch's (non-fused, non-capturable)
        AdamW keeps them on the host on a GPU too, where reading one waits for nothing."""
        self.host_scalars = {id(state["step"]) for state in optimizer.state.values()
                             if isinstance(state.get("step"), torch.Tensor) and state["step"].device.type == "cpu"}

    def mark(self) -> None:
        now = (self.ops, self.syncs, time.perf_counter(), Counter(self.sync_names), self.kernels)
        if self._last is not None:
            ops, syncs, start, names, kernels = self._last
            self.windows.append({"ops": now[0] - ops, "syncs": now[1] - syncs, "seconds": now[2] - start,
                                 "sync_ops": dict(now[3] - names), "kernels": now[4] - kernels})
        self._last = now

    @contextlib.contextmanager
    def active(self):
        """Count within (dispatch mode, the host reads that bypass dispatch, synchronize calls)."""
        with contextlib.ExitStack() as stack:
            if self.count:
                stack.enter_context(self._patched_host_reads())
                stack.enter_context(self)
            yield self

    @contextlib.contextmanager
    def _patched_host_reads(self):
        from deepspeed.accelerator import get_accelerator

        accelerator = type(get_accelerator())
        saved = [(torch.Tensor, "tolist"), (torch.cuda, "synchronize"), (accelerator, "synchronize")]
        originals = [getattr(owner, name) for owner, name in saved]

        def counted(original, name):
            def call(*args, **kwargs):
                self._sync(name)
                return original(*args, **kwargs)
            return call

        for (owner, name), original in zip(saved, originals):
            setattr(owner, name, counted(original, f"{getattr(owner, '__name__', owner)}.{name}"))
        try:
            yield
        finally:
            for (owner, name), original in zip(saved, originals):
                setattr(owner, name, original)

    def summary(self, skip: int = WARMUP - 1) -> dict:
        """Means over the windows after the first `skip` (the first window follows step 1)."""
        windows = self.windows[skip:]
        names: Counter = Counter()
        for w in windows:
            names.update(w["sync_ops"])
        n = len(windows)
        return {"steps": n, "ops_per_step": sum(w["ops"] for w in windows) / n,
                "kernel_ops_per_step": sum(w["kernels"] for w in windows) / n,
                "syncs_per_step": sum(w["syncs"] for w in windows) / n,
                "host_ms_per_step": 1e3 * statistics.mean(w["seconds"] for w in windows),
                "sync_ops_per_step": {k: v / n for k, v in sorted(names.items())}}


@contextlib.contextmanager
def engine_steps_marked(counter: StepCounter):
    """Within it, each DeepSpeed engine step that completes an optimizer step calls counter.mark()."""
    from deepspeed.runtime.engine import DeepSpeedEngine
    from msds.compat import deepspeed_0_19 as ds_compat

    step = DeepSpeedEngine.step

    def marked(engine, *args, **kwargs):
        before = engine.global_steps
        out = step(engine, *args, **kwargs)
        if engine.global_steps != before:
            counter.mark()
            counter.note_host_scalars(ds_compat.base_optimizer(engine))
        return out

    DeepSpeedEngine.step = marked
    try:
        yield
    finally:
        DeepSpeedEngine.step = step


# -- the model and data -----------------------------------------------------------------------------

def model_overrides(corpus: str, precision: str, width: int, layers: int, batch: int, seq: int) -> list[str]:
    """BERT-Large's structure (its preset: 24 layers, post-LN, MLM head) at `width`, on the corpus."""
    return ["model.preset=bert-large", f"model.hidden_size={width}", "model.num_heads=4", f"model.num_layers={layers}",
            "model.vocab_size=1024", "model.max_positions=512", f"data.path={corpus}", f"data.seq_len={seq}",
            f"training.micro_batch_size={batch}", f"training.precision={precision}", "multilevel.enabled=false"]


def msds_config(corpus, precision, run_dir, steps, shape, extra=()):
    from msds.config import load_run_config

    # The default logging (interval, TensorBoard); no evaluation or checkpoint inside the windows.
    return load_run_config(REPO / "recipes" / "test" / "test-vcycle-bert.yaml", [
        *model_overrides(corpus, precision, *shape), f"run_dir={run_dir}", f"training.steps={steps}",
        "logging.interval=10", "logging.tensorboard=true", f"logging.eval_interval={steps + 1}",
        "logging.eval_batches=1", "optimizer.warmup_steps=2", *extra])


def msds_row(corpus, precision, steps, shape, count, extra=()) -> dict:
    """`msds train` (msds.train.loop.train, the real loop) with its windows counted."""
    from msds.train.loop import train

    counter = StepCounter(count)
    with tempfile.TemporaryDirectory() as run_dir, engine_steps_marked(counter), counter.active():
        train(msds_config(corpus, precision, run_dir, steps + WARMUP, shape, extra))
    return counter.summary()


def hand_row(corpus, precision, steps, shape, count, model: str, extra=()) -> dict:
    """A plain torch loop: `model` "msds" (msds's Transformer) or "hf" (BertForMaskedLM, same
    shape), fused AdamW, foreach gradient clipping; in bf16 the weights are bf16 (no fp32 master
    copy: msds's block-wise loss is no autocast function); the loss is never read."""
    from msds.data import train_batches
    from msds.plan import build_plan

    with tempfile.TemporaryDirectory() as run_dir:
        cfg = msds_config(corpus, precision, run_dir, steps + WARMUP, shape, extra)
    plan = build_plan(cfg)
    torch.manual_seed(0)
    net = build_model(plan, model).to(torch.bfloat16 if precision == "bf16" else torch.float32)
    groups = _weight_decay_groups(net, cfg.optimizer.weight_decay)
    opt = torch.optim.AdamW(groups, lr=cfg.optimizer.lr, fused=True)
    batches = train_batches(cfg.data, "bert", cfg.data.seq_len, cfg.training.micro_batch_size, cfg.data.seed, 0, 1)
    counter = StepCounter(count)
    with counter.active():
        for _ in range(steps + WARMUP):
            batch = next(batches)
            if model == "hf":   # the positions are msds's
                batch.pop("masked_positions", None)
            loss = net(**batch)
            loss = loss if model == "msds" else loss.loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), cfg.optimizer.grad_clip, foreach=True)
            opt.step()
            opt.zero_grad(set_to_none=True)
            counter.mark()
    return counter.summary()


def build_model(plan, model: str) -> torch.nn.Module:
    from msds.model.transformer import Transformer

    cfg = plan.model(1)
    if model == "msds":
        return Transformer(cfg, padded_vocab_size=plan.padded_vocab_size).train()
    import transformers
    from msds.model.hf import config_to_hf

    return transformers.BertForMaskedLM(transformers.BertConfig(**config_to_hf(cfg), attn_implementation="sdpa")).train()


def _weight_decay_groups(net, weight_decay):
    decay = [p for p in net.parameters() if p.dim() >= 2]
    rest = [p for p in net.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


ROWS = {"msds train": lambda *a, **k: msds_row(*a, **k),
        "torch loop, msds model": lambda *a, **k: hand_row(*a, **k, model="msds"),
        "torch loop, HF BertForMaskedLM": lambda *a, **k: hand_row(*a, **k, model="hf")}


def measure(corpus: str, precisions, steps: int, shape, extra=(), rows=tuple(ROWS)) -> list[dict]:
    """One record per (row, precision): counted figures and the host time of an uncounted run.
    `extra`: msds config overrides for every row (e.g. data.max_predictions_per_seq=20)."""
    out = []
    for precision in precisions:
        for name in rows:
            counted = ROWS[name](corpus, precision, steps, shape, count=True, extra=extra)
            timed = ROWS[name](corpus, precision, steps, shape, count=False, extra=extra)
            out.append({"row": name, "precision": precision, "ops_per_step": counted["ops_per_step"],
                        "kernel_ops_per_step": counted["kernel_ops_per_step"],
                        "syncs_per_step": counted["syncs_per_step"], "sync_ops_per_step": counted["sync_ops_per_step"],
                        "host_ms_per_step": timed["host_ms_per_step"], "steps": counted["steps"]})
            print(json.dumps(out[-1]), flush=True)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(Path.home() / ".cache" / "msds" / "test-data" / "default-bpe-1024"))
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=20, help="measured steps after the warm-up (default 20)")
    parser.add_argument("--precision", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS), metavar="ROW",
                        help=f"which loops to measure (default all: {', '.join(ROWS)})")
    parser.add_argument("--set", nargs="*", default=[], metavar="key=value",
                        help="msds config overrides for every row, e.g. data.max_predictions_per_seq=20")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from msds.distributed import init_distributed

    init_distributed()
    import deepspeed
    import transformers

    shape = (args.width, args.layers, args.batch, args.seq)
    rows = measure(args.data, args.precision, args.steps, shape, args.set, args.rows)
    args.json.write_text(json.dumps({
        "setting": {"machine": "CPU", "threads": args.threads, "versions": f"torch {torch.__version__}, deepspeed "
                    f"{deepspeed.__version__}, transformers {transformers.__version__}",
                    "overrides": args.set, "shape": {"width": args.width, "layers": args.layers, "micro_batch": args.batch, "seq": args.seq},
                    "command": "python benchmarks/host_overhead.py " + " ".join(argv or sys.argv[1:]),
                    "date": time.strftime("%Y-%m-%d")},
        "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
