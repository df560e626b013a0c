"""The contract's comparator: an element passes if both values are finite and |opt - ref| <= atol or
|opt - ref| <= rtol * |ref|; a shape passes with zero failed elements."""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

TOLERANCES = {
    "official": {"atol": 2e-3, "rtol": 2e-2},
    "strict": {"atol": 1e-3, "rtol": 1e-2},
}


@dataclass(frozen=True)
class Comparison:
    passed: bool
    total_elements: int
    failed_elements: int
    max_abs_error: float
    max_rel_error: float
    mean_abs_error: float
    worst_index: tuple

    def as_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["worst_index"] = list(self.worst_index)
        return out


def compare_outputs(reference: torch.Tensor, optimized: torch.Tensor, rtol: float, atol: float) -> Comparison:
    """Element passes if both are finite and |opt - ref| <= atol or |opt - ref| <= rtol * |ref|."""
    for name, tensor in (("reference", reference), ("optimized", optimized)):
        if type(tensor) is not torch.Tensor:  # a subclass's __torch_function__ would answer the arithmetic below
            raise TypeError(f"compare_outputs: the {name} output is a {type(tensor).__module__}."
                            f"{type(tensor).__qualname__}, not a plain torch.Tensor")
    if reference.shape != optimized.shape:
        raise ValueError(f"compare_outputs: reference shape {tuple(reference.shape)} != optimized shape "
                         f"{tuple(optimized.shape)}")
    ref = reference.detach().to(torch.float64)
    opt = optimized.detach().to(device=ref.device, dtype=torch.float64)
    diff = (opt - ref).abs()
    finite = torch.isfinite(ref) & torch.isfinite(opt)
    ok = finite & ((diff <= atol) | (diff <= rtol * ref.abs()))
    total = ref.numel()
    failed = int(total - ok.sum().item())
    diff_finite = torch.where(finite, diff, torch.zeros_like(diff))
    rel = diff_finite / ref.abs().clamp_min(1e-12)
    # the worst element: a failing one with the largest error, else the largest error overall
    badness = torch.where(finite, diff, torch.full_like(diff, math.inf)) + (~ok).to(torch.float64) * 1e300
    worst_flat = int(torch.argmax(badness).item()) if total else 0
    worst = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst_flat), ref.shape)) if total else ()
    return Comparison(
        passed=failed == 0,
        total_elements=int(total),
        failed_elements=failed,
        max_abs_error=float(diff_finite.max().item()) if total else 0.0,
        max_rel_error=float(rel.max().item()) if total else 0.0,
        mean_abs_error=float(diff_finite.mean().item()) if total else 0.0,
        worst_index=worst,
    )
