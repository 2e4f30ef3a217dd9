"""Paged KV-cache kernels and a skinny GEMM as torch ops (namespace `pagedserve`), plus their pure-torch reference.

    ops = cuda_ext.load_ops("ext")    # compiled C++/CUDA ops, built on first use
    ops = cuda_ext.load_ops("torch")  # cuda_ext.reference, same signatures

KV layout: cuda_ext/README.md.
"""

from cuda_ext import reference
from cuda_ext.linear import PackedLinear, pack_linear
from cuda_ext.ops import HEAD_SIZES, KernelOps, is_built, load_ops

__all__ = ["HEAD_SIZES", "KernelOps", "PackedLinear", "is_built", "load_ops", "pack_linear", "reference"]
