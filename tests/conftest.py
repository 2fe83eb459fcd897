"""Shared test setup: offline Hugging Face, quiet logs, one-process megatron parallel state."""
import os
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
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


@pytest.fixture(scope="session")
def train_corpus():
    """The real default corpus with a 1024-entry BPE (GPT and BERT specials), prepared once and
    cached across sessions; `msds data prepare` does nothing when it is already up to date."""
    import subprocess
    import sys
    from pathlib import Path

    cache = Path(os.environ.get("MSDS_TEST_CACHE", Path.home() / ".cache" / "msds" / "test-data"))
    out = cache / "default-bpe-1024"
    subprocess.run([sys.executable, "-m", "msds.cli", "data", "prepare", "--tokenizer", "bpe-1024",
                    "--out", str(out)], check=True, stdout=subprocess.DEVNULL)
    return out


@pytest.fixture(scope="session")
def two_process_results(train_corpus, tmp_path_factory):
    """One torchrun launch of 2 gloo processes running every multi-process training check
    (tests/dist/train_checks.py); the tests assert on its results."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    work = tmp_path_factory.mktemp("dist")
    results = work / "results.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           str(repo / "tests" / "dist" / "train_checks.py"), str(train_corpus), str(work),
                           str(results)], env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(results.read_text())
