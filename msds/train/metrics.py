"""Run metrics: a console progress line, a JSONL file and TensorBoard events (rank 0 writes)."""
from __future__ import annotations

import json
import time
from pathlib import Path

METRICS_FILE = "metrics.jsonl"


class MetricsLogger:
    """Every event goes to metrics.jsonl as one JSON object with an `event` field: `step`, `eval`,
    `transition`, `checkpoint`, `start`, `resume`. Steps are printed, and written to TensorBoard, every
    `interval` steps (metrics.jsonl gets every step: reports read each step's loss)."""

    def __init__(self, run_dir: Path, enabled: bool, interval: int, total_steps: int, tensorboard: bool):
        self.enabled, self.interval, self.total_steps = enabled, interval, total_steps
        self.writer = None
        self.file = None
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        self.file = open(run_dir / METRICS_FILE, "a", buffering=1)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(run_dir / "tensorboard"))

    def _write(self, record: dict) -> None:
        record = {"time": round(time.time(), 3), **record}
        self.file.write(json.dumps(record) + "\n")

    def step(self, record: dict) -> None:
        if not self.enabled:
            return
        self._write({"event": "step", **record})
        step = record["step"]
        if step % self.interval and step != self.total_steps:
            return
        if self.writer:
            for key in ("loss", "lr", "level", "tokens_per_s", "flops", "train_seconds"):
                self.writer.add_scalar(f"train/{key}", record[key], step)
        print(f"step {step:>6}/{self.total_steps} | level {record['level']} | loss {record['loss']:.4f} "
              f"| lr {record['lr']:.2e} | {record['tokens_per_s']:,.0f} tok/s | {record['flops']:.3e} FLOPs "
              f"| {record['train_seconds']:.1f} s", flush=True)

    def eval(self, record: dict) -> None:
        if not self.enabled:
            return
        self._write({"event": "eval", **record})
        if self.writer:
            self.writer.add_scalar("eval/loss", record["val_loss"], record["step"])
            self.writer.add_scalar("eval/perplexity", record["val_ppl"], record["step"])
            self.writer.add_scalar("eval/loss_vs_flops", record["val_loss"], int(record["flops"] / 1e6))
        if self.writer and "val_sop_accuracy" in record:
            self.writer.add_scalar("eval/sop_accuracy", record["val_sop_accuracy"], record["step"])
        sop = f" | SOP accuracy {record['val_sop_accuracy']:.3f}" if "val_sop_accuracy" in record else ""
        print(f"eval at step {record['step']}: level {record['level']} | val loss {record['val_loss']:.4f} "
              f"| ppl {record['val_ppl']:.2f}{sop}", flush=True)

    def event(self, kind: str, record: dict, message: str) -> None:
        if not self.enabled:
            return
        self._write({"event": kind, **record})
        print(message, flush=True)

    def close(self) -> None:
        if self.writer:
            self.writer.close()
        if self.file:
            self.file.close()


def read_metrics(run_dir: Path, event: str | None = None) -> list[dict]:
    """The records of a run's metrics.jsonl (optionally of one event kind), as its history stands.
    A run stopped without a checkpoint at its last step (killed, out of time) logged steps and
    evaluations past its last checkpoint; the resume from step S trains them again, so its `resume`
    record drops the earlier records of steps after S, and a `start` record (a start from step 0,
    when no checkpoint was there to resume) drops every earlier record: each step is read once, in
    order, and a report never sees the abandoned attempt's losses or clock."""
    path = Path(run_dir) / METRICS_FILE
    records: list[dict] = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        record = json.loads(line)
        if record["event"] == "start":
            records = []
        elif record["event"] == "resume":
            records = [r for r in records if r.get("step", 0) <= record["step"]]
        records.append(record)
    return [r for r in records if event is None or r["event"] == event]
