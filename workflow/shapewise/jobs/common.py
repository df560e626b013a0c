"""What every measuring job shares: the row, inputs, models, timers, output.

Imported only inside a job process, after the CLI has set TRITON_INTERPRET
for CPU runs.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from shapewise.fingerprint import job_environment

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
WEIGHT_SEED = 0          # every model of a row starts from torch.manual_seed(WEIGHT_SEED)
FIRST_TRIAL_SEED = 1234  # trial t draws its inputs with seed 1234 + t
MASK_SEED_OFFSET = 7919  # left/holes masks come from their own generator, seed + this


def log(message):
    stamp = datetime.now().strftime("%H:%M:%S")
    print(f"[{stamp}] {message}", flush=True)


def now_iso():
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def setup(device, threads=None):
    if threads:
        torch.set_num_threads(int(threads))
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("device cuda was chosen but torch sees no CUDA GPU (set SHAPEWISE_DEVICE=cpu?)")
    return torch.device(device)


def model_config(row):
    from shapewise.model import TransformerConfig
    from shapewise.manifest import MODEL_FIELDS

    return TransformerConfig(**{name: row[name] for name in MODEL_FIELDS}).validate()


def header(step, row, device):
    """The fields every result file starts with."""
    return {
        "step": step,
        "shape": row["id"] if row else None,
        "row": row,
        "device": device,
        "environment": job_environment(device),
        "started": now_iso(),
        "_t0": time.perf_counter(),
    }


def write_result(path, result):
    t0 = result.pop("_t0", None)
    result["finished"] = now_iso()
    if t0 is not None:
        result["duration_s"] = round(time.perf_counter() - t0, 3)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=2, sort_keys=True, default=_json_default) + "\n")
    os.replace(tmp, path)
    log(f"wrote {path}")


def _json_default(obj):
    if isinstance(obj, (torch.dtype, torch.device)):
        return str(obj)
    if isinstance(obj, tuple):
        return list(obj)
    raise TypeError(f"not JSON serializable: {type(obj).__name__}")


def read_json(path):
    with open(path) as fh:
        return json.load(fh)


# ---------------------------------------------------------------- inputs


# Inputs of at least this many elements are drawn on the GPU (official row 14: 3.3e9 elements, estimated at
# about 20 s per case on a CPU that draws 10^8 normal values in 0.6 s, five cases in its accuracy job alone);
# smaller ones on the CPU, so a seed gives the same case on every device.
DEVICE_DRAW_MIN_ELEMENTS = 2**30


def input_generator(config, device) -> str:
    """generate_random_case's generator_device for this shape on this device ("cpu" or "device")."""
    big = config.batch_size * config.seq_len * config.d_model >= DEVICE_DRAW_MIN_ELEMENTS
    return "device" if big and torch.device(device).type == "cuda" else "cpu"


def make_case(row, config, device, seed):
    """Inputs of one trial: x in the row's dtype and the valid-token mask.

    prefix masks come from model.generate_random_case. left and holes masks
    use the same length rule (lengths in [max(1, round(S(1-p))), S]) from a
    generator seeded with seed + MASK_SEED_OFFSET: left puts the padding
    first, holes scatters it over random positions. Padded rows of x are
    zeroed in every case. Returns (x, mask or None, mask_kind) with
    mask_kind in none/prefix/general for model.routing.
    """
    from shapewise.model import generate_random_case

    dtype = DTYPES[row["dtype"]]
    kind = row["mask"]
    ratio = row["padding_ratio"] if kind == "prefix" else 0.0
    x, mask = generate_random_case(config, device, dtype, seed, padding_ratio=ratio,
                                   input_scale=row["input_scale"], generator_device=input_generator(config, device))
    if kind in ("none", "prefix"):
        return x, mask, kind
    B, S = config.batch_size, config.seq_len
    gen = torch.Generator(device="cpu").manual_seed(int(seed) + MASK_SEED_OFFSET)
    low = max(1, round(S * (1.0 - row["padding_ratio"])))
    lengths = torch.randint(low, S + 1, (B,), generator=gen)
    positions = torch.arange(S)
    if kind == "left":
        mask = positions[None, :] >= (S - lengths)[:, None]
    else:  # holes
        mask = torch.zeros(B, S, dtype=torch.bool)
        for b in range(B):
            keep = torch.randperm(S, generator=gen)[: int(lengths[b])]
            mask[b, keep] = True
    mask = mask.to(device)
    x = x.masked_fill(~mask[..., None], 0.0)
    return x, mask, "general"


# ---------------------------------------------------------------- models


def build_models(row, config, device, disable=(), reference_dtype=None):
    """(reference, optimized) with identical weights.

    The optimized model runs in the row's dtype. The reference gets the same
    weights rounded to the row's dtype and is kept in `reference_dtype`
    (default: float32), so it computes exact math on the very parameters the
    optimized model uses.
    """
    from shapewise.model import BaselineTransformer, UserOptimizedTransformer

    dtype = DTYPES[row["dtype"]]
    torch.manual_seed(WEIGHT_SEED)
    reference = BaselineTransformer(config)
    optimized = UserOptimizedTransformer(config, route=row["route"], disable=tuple(disable))
    optimized.load_state_dict(reference.state_dict(), strict=True)
    optimized = optimized.to(device=device, dtype=dtype).eval()
    reference = reference.to(dtype=dtype).to(device=device, dtype=reference_dtype or torch.float32).eval()
    return reference, optimized


def build_optimized(row, config, device, disable=()):
    from shapewise.model import BaselineTransformer, UserOptimizedTransformer

    torch.manual_seed(WEIGHT_SEED)
    reference = BaselineTransformer(config)
    optimized = UserOptimizedTransformer(config, route=row["route"], disable=tuple(disable))
    optimized.load_state_dict(reference.state_dict(), strict=True)
    return optimized.to(device=device, dtype=DTYPES[row["dtype"]]).eval()


def route_of(model):
    route = getattr(model, "last_route", None)
    if route is None:
        return None, None
    return str(route), route.as_dict()


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


# ---------------------------------------------------------------- timing


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_calls(fn, device, count):
    """Milliseconds of each of `count` calls: a CUDA event pair per call on a
    GPU (the GPU time between the two events, launch gaps included), or
    time.perf_counter around each call on the CPU."""
    if count <= 0:
        return []
    if device.type == "cuda":
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(count)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(count)]
        for start, end in zip(starts, ends):
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return [s.elapsed_time(e) for s, e in zip(starts, ends)]
    times = []
    for _ in range(count):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def first_call_ms(fn, device):
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return (time.perf_counter() - t0) * 1e3


def summarize(times_ms):
    if not times_ms:
        return None
    ordered = sorted(times_ms)
    p90_index = min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)
    return {
        "count": len(ordered),
        "median_ms": statistics.median(ordered),
        "p90_ms": ordered[p90_index],
        "min_ms": ordered[0],
        "max_ms": ordered[-1],
        "mean_ms": statistics.fmean(ordered),
    }


def peak_memory_reset(device):
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def peak_memory_bytes(device):
    if device.type == "cuda":
        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_allocated())
    return None


def free_memory_bytes(device):
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info()
        return int(free), int(total)
    available = total = None
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
            elif line.startswith("MemTotal:"):
                total = int(line.split()[1]) * 1024
    return available, total


def fail(message):
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(1)
