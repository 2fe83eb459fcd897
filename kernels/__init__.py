"""Fused Triton kernels for the multi-level operators: coalesce (a gather-mean) and de-coalesce +
interpolate (a gather-copy, then lerp), on 2-D tensors, in one pass each (kernels.multilevel).

This package imports nothing from msds: a grouping reaches it as element-level int32 index maps
and a scale, and bad arguments raise ValueError. Its caller decides when the kernels run (in this
repository msds.multilevel.backends). Importing this package does not import triton;
kernels.multilevel does.
"""
import importlib.util

import torch

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def triton_available() -> bool:
    """Whether triton (the optional extra `kernels` of msds) is installed, checked without importing it."""
    return importlib.util.find_spec("triton") is not None
