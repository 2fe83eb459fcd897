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
