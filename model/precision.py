"""cuBLAS's fp32 GEMM mode for a block of code, restored afterwards.

Through PyTorch's per-backend setting `torch.backends.cuda.matmul.fp32_precision` where it exists (torch >= 2.9):
a process that set that setting refuses reads of the legacy `allow_tf32` flag ("mix of the legacy and new APIs"),
and a process that set only the legacy flag reads it back through the per-backend setting, so saving and
restoring the per-backend value works under either. The legacy flag on older torch.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch


@contextmanager
def cublas_fp32(tf32: bool):
    """fp32 cuBLAS GEMMs on TF32 tensor cores (`tf32`) or in exact fp32 inside the block."""
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):
        before = matmul.fp32_precision
        matmul.fp32_precision = "tf32" if tf32 else "ieee"
        try:
            yield
        finally:
            matmul.fp32_precision = before
        return
    before = matmul.allow_tf32
    matmul.allow_tf32 = tf32
    try:
        yield
    finally:
        matmul.allow_tf32 = before
