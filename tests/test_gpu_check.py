"""benchmarks/gpu_check.py's CPU path: every section runs end to end at tiny sizes and reports
values that make sense (the GPU figures come from the same code on a GPU)."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_gpu_check_runs_on_the_cpu(train_corpus, tmp_path):
    pytest.importorskip("triton")
    out = tmp_path / "check.json"
    # Not this process's one-process world variables: the child would take DeepSpeed's launcher path.
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--cpu", "--data",
                           str(train_corpus), "--json", str(out)], env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["device"] == "cpu" and result["goals"] is None
    vcycle = result["vcycle"]
    # On the CPU both backends run PyTorch: the same training to the bit, through 4 transitions.
    assert vcycle["steps"] == 15 and vcycle["transitions"] == 4 and not vcycle["kernels_in_auto"]
    assert vcycle["identical"] and vcycle["max_abs_loss_difference"] == 0.0
    assert all(math.isfinite(v) for v in vcycle["losses_auto"])
    # Fused AdamW steps through the same transitions (its arithmetic differs a little).
    assert vcycle["fused_adamw_transitions"] == 4 and len(vcycle["losses_fused_adamw"]) == 15
    assert vcycle["fused_adamw_max_abs_loss_difference"] < 0.05
    step = result["step"]
    assert step["msds_s"] > 0 and step["flops_per_step"] > 0 and step["hf_s"] is None and step["msds_mfu"] is None
    assert step["msds_fused_adamw_s"] > 0
    transition = result["transition"]
    assert transition["down_s"] > 0 and transition["up_s"] > 0
    assert transition["pair_in_steps"] == pytest.approx((transition["down_s"] + transition["up_s"]) / step["msds_s"])
    kernels = result["kernels"]
    assert kernels["correct"] and kernels["failures"] == [] and kernels["bandwidth"] == []
    # Sections 5-9: the step's profile, Hugging Face's references, shapes, a real transition pair,
    # the fast-step settings (figures on a GPU only; here that each runs and reports sane values).
    profile = result["profile"]
    assert profile["kernels_per_step"] is None and profile["device_busy_fraction"] is None
    assert len(profile["top10"]) == 10 and all(op["ms_per_step"] >= 0 for op in profile["top10"])
    assert result["hf_references"]["eager_s"] > 0 and result["hf_references"]["compiled_s"] > 0
    shapes = result["shapes"]
    assert [row["model"] for row in shapes] == ["bert-tiny"] * 3 + ["gpt-tiny"]
    assert all(row["seconds"] > 0 and row["mfu"] is None for row in shapes)
    transitions = result["vcycle_transitions"]
    assert transitions["down_s"] > 0 and transitions["up_s"] > 0 and transitions["pair_in_steps"] > 0
    fast = result["fast_step"]
    assert [row["setting"] for row in fast][0] == "defaults" and fast[0]["vs_defaults"] == 1.0
    assert "training.compile=true" in {row["setting"] for row in fast} and all(row["seconds"] > 0 for row in fast)
