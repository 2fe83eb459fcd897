"""msds: multi-level (V-cycle) BERT/GPT pretraining integrated with DeepSpeed and megatron-core."""

__version__ = "0.1.0"
