"""Shared test setup: offline Hugging Face, quiet logs, one-process megatron parallel state."""
import os
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Triton runs here only under its interpreter, and reads this switch when it is first imported
# (megatron-core imports it with msds.model.transformer): set for the whole session, so that
# tests/test_kernels.py runs wherever it falls in the order. No other test runs a Triton kernel.
os.environ.setdefault("TRITON_INTERPRET", "1")
warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
warnings.filterwarnings("ignore", category=DeprecationWarning)

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def one_process_parallel_state():
    """Every in-process test runs as a one-process world with TP=1 (megatron layers need it)."""
    from msds.distributed import init_distributed

    init_distributed()
    torch.set_num_threads(2)
    yield


def _prepared(tokenizer: str):
    """The real default corpus tokenized by `tokenizer`, prepared once and cached across sessions;
    `msds data prepare` does nothing when it is already up to date."""
    import subprocess
    import sys
    from pathlib import Path

    cache = Path(os.environ.get("MSDS_TEST_CACHE", Path.home() / ".cache" / "msds" / "test-data"))
    out = cache / f"default-{tokenizer}"
    subprocess.run([sys.executable, "-m", "msds.cli", "data", "prepare", "--tokenizer", tokenizer,
                    "--out", str(out)], check=True, stdout=subprocess.DEVNULL)
    return out


@pytest.fixture(scope="session")
def train_corpus():
    """The real default corpus with a 1024-entry BPE (GPT and BERT specials)."""
    return _prepared("bpe-1024")


@pytest.fixture(scope="session")
def bert_corpus():
    """The real default corpus with the real BERT vocabulary (all-MiniLM-L6-v2's, 30522 entries)."""
    return _prepared("bert")


def _launch(suite: str, processes: int, corpus, work):
    """One torchrun launch of `processes` gloo processes running a suite of tests/dist/train_checks.py."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    results = work / "results.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes),
                           str(repo / "tests" / "dist" / "train_checks.py"), suite, str(corpus), str(work),
                           str(results)], env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(results.read_text())


@pytest.fixture(scope="session")
def two_process_results(train_corpus, tmp_path_factory):
    """Every 2-process training check (ZeRO stages, resume, random-LTD, TP=2, PP=2), one launch."""
    return _launch("two", 2, train_corpus, tmp_path_factory.mktemp("dist2"))


@pytest.fixture(scope="session")
def four_process_results(train_corpus, tmp_path_factory):
    """The 4-process checks (pipeline x data and pipeline x tensor parallelism), one launch."""
    return _launch("four", 4, train_corpus, tmp_path_factory.mktemp("dist4"))


@pytest.fixture(scope="session")
def launch(train_corpus):
    """`launch(suite, processes, work)`: one launch of a suite of tests/dist/train_checks.py whose
    runs start from files the test prepared in `work` (tests/test_relayout.py)."""
    return lambda suite, processes, work: _launch(suite, processes, train_corpus, work)


@pytest.fixture(scope="session")
def one_process_losses(train_corpus, tmp_path_factory):
    """Per-step losses of a one-process run of recipes/test/test-vcycle-<arch>.yaml with overrides,
    computed once per (arch, overrides): the references the parallel runs are compared with."""
    from pathlib import Path

    from msds.config import load_run_config
    from msds.train.loop import train
    from msds.train.metrics import read_metrics

    repo = Path(__file__).resolve().parents[1]
    cache = {}

    def losses(arch: str, *overrides: str) -> dict[str, float]:
        key = (arch, overrides)
        if key not in cache:
            run_dir = tmp_path_factory.mktemp(f"one-{arch}")
            cfg = load_run_config(repo / "recipes" / "test" / f"test-vcycle-{arch}.yaml",
                                  [f"data.path={train_corpus}", f"run_dir={run_dir}", "logging.tensorboard=false",
                                   *overrides])
            train(cfg)
            cache[key] = {str(r["step"]): r["loss"] for r in read_metrics(run_dir, "step")}
        return cache[key]

    return losses


BUILD_SHM_OP = """
from msds.compat import deepspeed_0_19
deepspeed_0_19.use_one_extension_cache()
from deepspeed.accelerator import get_accelerator
get_accelerator().create_op_builder("ShareMemCommBuilder").load(verbose=False)
print(deepspeed_0_19.extension_cache())
"""


@pytest.fixture(scope="session")
def extension_cache():
    """`extension_cache(path)`: a copy at `path` of this environment's cache of DeepSpeed's JIT-built
    ops (msds.compat.deepspeed_0_19.use_one_extension_cache), with the CPU communication op that
    every launched CPU run loads built (here, once, if it is not yet), for a test to plant in."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    env = {key: value for key, value in os.environ.items() if key not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    built = subprocess.run([sys.executable, "-c", BUILD_SHM_OP], env=env, check=True, capture_output=True,
                           text=True, timeout=900)
    source = Path(built.stdout.strip().splitlines()[-1])

    def copy(path: Path) -> Path:
        shutil.copytree(source, path, ignore=shutil.ignore_patterns("lock", "msds.lock"))
        return path

    return copy
