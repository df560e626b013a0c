"""Shared test setup for shapewise.

The first lines matter: Triton reads ``TRITON_INTERPRET`` when it is imported, so the variable must be set
before anything (``kernels``, ``model``) imports triton. ``import torch`` does not import triton (checked:
``'triton' in sys.modules`` is False after ``import torch; torch.cuda.is_available()``), so asking torch
whether CUDA exists first is safe.
"""

import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # No GPU: run Triton kernels on the CPU through the interpreter.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import random  # noqa: E402

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    # `gpu`, `slow` and `slurm` are declared in pyproject.toml; nothing is registered here.
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="no CUDA device: torch.cuda.is_available() is False")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _seed_everything():
    """Every test starts from the same RNG state, so a failure reproduces on its own."""
    random.seed(0)
    torch.manual_seed(0)
    try:
        import numpy as np

        np.random.seed(0)
    except ImportError:  # pragma: no cover
        pass
    yield


def _close_report(actual, expected, atol, rtol, what):
    """Element passes if both finite and (|a-e| <= atol or |a-e| <= rtol*|e|): the project's rule, done here
    independently in fp64. Returns None if all pass, else a message with the count and the worst element."""
    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    assert a.shape == e.shape, f"{what}: shape {tuple(a.shape)} != expected {tuple(e.shape)}"
    diff = (a - e).abs()
    ok = torch.isfinite(a) & torch.isfinite(e) & ((diff <= atol) | (diff <= rtol * e.abs()))
    if bool(ok.all()):
        return None
    bad = (~ok).nonzero()
    # worst by excess over the allowance (NaN counts as worst)
    excess = torch.where(ok, torch.zeros_like(diff), torch.nan_to_num(diff - torch.maximum(
        torch.full_like(diff, atol), rtol * e.abs()), nan=float("inf")))
    idx = tuple(int(i) for i in torch.unravel_index(excess.argmax(), excess.shape))
    return (f"{what}: {bad.shape[0]}/{a.numel()} elements outside atol={atol} rtol={rtol}; "
            f"worst at {idx}: got {a[idx].item()!r}, expected {e[idx].item()!r}; "
            f"max|diff|={torch.nan_to_num(diff, nan=float('inf')).max().item():.3e}")


@pytest.fixture
def assert_close():
    def _assert_close(actual, expected, *, atol, rtol, what="tensor"):
        msg = _close_report(actual, expected, atol, rtol, what)
        assert msg is None, msg

    return _assert_close
