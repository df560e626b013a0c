"""The contract's comparator: an element passes if both values are finite and |opt - ref| <= atol or
|opt - ref| <= rtol * |ref|; a shape passes with zero failed elements. The errors are measured over the finite
pairs, so the non-finite elements are counted apart: an output of NaN must not read "max abs error 0"."""
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
    nonfinite_elements: int  # elements where either output is NaN or +-inf: each fails, none enters the errors
    max_abs_error: float  # over the finite pairs (as max_rel_error and mean_abs_error)
    max_rel_error: float
    mean_abs_error: float
    worst_index: tuple

    def as_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["worst_index"] = list(self.worst_index)
        return out

    def describe(self) -> str:
        return describe_comparison(self.as_dict())


def describe_comparison(fields, tolerance: str = "the tolerance") -> str:
    """One sentence on a comparison: a Comparison's as_dict(), or a sum of several with the same keys. Non-finite
    elements are named apart from the error, which covers the finite pairs only."""
    failed, total = fields["failed_elements"], fields["total_elements"]
    nonfinite = fields.get("nonfinite_elements") or 0
    text = f"{failed} of {total} elements outside {tolerance}"
    if not nonfinite:
        return f"{text} (max abs error {fields['max_abs_error']:.3g})"
    text += f", {nonfinite} of them non-finite (NaN or inf in the reference or the optimized output)"
    if nonfinite == total:
        return f"{text}; no finite pair to measure an error on"
    return f"{text}; max abs error over the finite pairs {fields['max_abs_error']:.3g}"


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
    nonfinite = int(total - finite.sum().item())
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
        nonfinite_elements=nonfinite,
        max_abs_error=float(diff_finite.max().item()) if total else 0.0,
        max_rel_error=float(rel.max().item()) if total else 0.0,
        mean_abs_error=float(diff_finite.mean().item()) if total else 0.0,
        worst_index=worst,
    )
