"""The data pipeline: `msds data prepare` writes verified memory-mapped token files; this package
turns them into GPT / BERT masked-LM batches in a resumable, data-parallel-sharded order.

Trainer-facing API:
    load_tokenizer_info(data_dir) -> TokenizerInfo
    open_split(data_dir, split) -> TokenDataset        (verifies the manifest's sha256s and counts)
    build_samples(dataset, arch, seq_len, seed, tokenizer_info) -> Samples
    ResumableSampler(num_samples, seed, dp_rank, dp_size, consumed_samples=0)
    train_batches(data_dir, arch, seq_len, micro_batch_size, seed, dp_rank, dp_size, consumed_samples=0)
    eval_batches(data_dir, split, arch, seq_len, batch_size, max_batches, seed=0)
"""
from msds.data.indexed import TokenDataset, load_tokenizer_info, open_split
from msds.data.loader import ResumableSampler, eval_batches, train_batches
from msds.data.samples import Samples, build_samples
from msds.data.tokenizer import TokenizerInfo

__all__ = ["TokenizerInfo", "load_tokenizer_info", "TokenDataset", "open_split", "Samples", "build_samples",
           "ResumableSampler", "train_batches", "eval_batches"]
