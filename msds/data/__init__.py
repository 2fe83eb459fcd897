"""The data pipeline: `msds data prepare` writes memory-mapped token files; this package turns them
(or Megatron `.bin`/`.idx` datasets, or a weighted blend of either) into GPT / BERT batches in a
resumable, data-parallel-sharded order.

Trainer-facing API:
    load_tokenizer_info(data_dir) -> TokenizerInfo
    open_split(data_dir, split) -> TokenDataset        (checks sizes and counts against the manifest)
    build_samples(dataset, arch, seq_len, seed, tokenizer_info) -> Samples
    ResumableSampler(num_samples, seed, dp_rank, dp_size, consumed_samples=0)
    train_batches(data, arch, seq_len, micro_batch_size, seed, dp_rank, dp_size, consumed_samples=0,
                  prefetch=0, pin_memory=False)
    eval_batches(data, split, arch, seq_len, batch_size, max_batches, seed=0)

The names are imported on first use (PEP 562), so that the tokenizer worker processes of
`msds data prepare` import numpy and tokenizers only, not torch.
"""
import importlib

_HOMES = {"TokenDataset": "indexed", "load_tokenizer_info": "indexed", "open_split": "indexed",
          "ResumableSampler": "loader", "eval_batches": "loader", "train_batches": "loader",
          "Samples": "samples", "build_samples": "samples", "TokenizerInfo": "tokenizer"}

__all__ = list(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"msds.data.{_HOMES[name]}"), name)
