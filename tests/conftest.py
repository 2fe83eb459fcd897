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
