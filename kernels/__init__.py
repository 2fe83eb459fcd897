"""Fused Triton kernels for the multi-level operators (coalesce, de-coalesce + interpolate).

Use `kernels.dispatch`: it runs the kernels on CUDA tensors when triton (the optional extra
`kernels`) is installed, and the PyTorch path (msds.multilevel.tensor_ops) otherwise. Importing this
package does not import triton.
"""
