"""The models of a row: the reference and the optimized model on the same weights, and how to call them."""

from __future__ import annotations

import torch

from shapewise.inputs.manifest import MODEL_FIELDS
from shapewise.jobs.inputs import DTYPES
from shapewise.model import BaselineTransformer, TransformerConfig, UserOptimizedTransformer

WEIGHT_SEED = 0  # every model of a row starts from torch.manual_seed(WEIGHT_SEED)


def model_config(row):
    return TransformerConfig(**{name: row[name] for name in MODEL_FIELDS}).validate()


def build_models(row, config, device, disable=(), reference_dtype=torch.float32):
    """(reference, optimized) with identical weights.

    The optimized model runs in the row's dtype. The reference gets the same weights rounded to the row's dtype
    and is kept in `reference_dtype` (default float32), so it computes exact math on the very parameters the
    optimized model uses. `reference_dtype=None`: no reference is kept (returned as None).
    """
    dtype = DTYPES[row["dtype"]]
    reference = seeded_reference(config)
    optimized = UserOptimizedTransformer(config, route=row["route"], disable=tuple(disable))
    optimized.load_state_dict(reference.state_dict(), strict=True)
    optimized = optimized.to(device=device, dtype=dtype).eval()
    if reference_dtype is None:
        return None, optimized
    return place_reference(reference, row, device, reference_dtype), optimized


def seeded_reference(config):
    """The reference whose weights every model of a row gets: BaselineTransformer(config) right after
    torch.manual_seed(WEIGHT_SEED), on the CPU in float32."""
    torch.manual_seed(WEIGHT_SEED)
    return BaselineTransformer(config)


def place_reference(reference, row, device, reference_dtype):
    """The reference on `device` in `reference_dtype`, its weights first rounded to the row's dtype (the very
    parameters the model it is compared with runs on)."""
    return reference.to(dtype=DTYPES[row["dtype"]]).to(device=device, dtype=reference_dtype).eval()


def build_optimized(row, config, device, disable=()):
    """The optimized model alone, on the weights build_models gives it."""
    return build_models(row, config, device, disable, reference_dtype=None)[1]


def route_of(model):
    route = getattr(model, "last_route", None)
    if route is None:
        return None, None
    return str(route), route.as_dict()


def call_of(mask):
    """How a job called the models, from the mask jobs.inputs.make_case returned for the row (its pass_mask)."""
    return "model(x)" if mask is None else "model(x, mask)"


def run_optimized(model, x, mask, row):
    """One optimized forward; a failure names the shape row and the input."""
    try:
        return model(x, mask)
    except Exception as exc:
        raise RuntimeError(
            f"shape {row['id']}: the optimized model failed on x {tuple(x.shape)} {x.dtype} "
            f"(mask {'none' if mask is None else tuple(mask.shape)}, route {row['route']!r}): "
            f"{type(exc).__name__}: {exc}"
        ) from exc


def set_precision(reference: bool):
    """Full fp32 for the reference; the timing protocol's 'high' otherwise."""
    torch.set_float32_matmul_precision("highest" if reference else "high")
    torch.backends.cuda.matmul.allow_tf32 = not reference
    torch.backends.cudnn.allow_tf32 = not reference
