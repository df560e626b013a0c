"""What the benchmarks share: rows, models and inputs as the pipeline builds them, timers, accuracy, output files."""
from __future__ import annotations

import argparse
import ast
import importlib
import json
import statistics
from contextlib import contextmanager
from pathlib import Path

import torch

from shapewise.inputs.manifest import load_manifest, normalize_row, official_rows
from shapewise.jobs.device import time_calls
from shapewise.jobs.inputs import FIRST_TRIAL_SEED, make_case
from shapewise.jobs.models import build_models, model_config, set_precision
from shapewise.model import TOLERANCES, compare_outputs

ROOT = Path(__file__).resolve().parent.parent
CUDA = torch.device("cuda")


def parser(doc, out_default):
    """An argument parser whose description is the script's one-line purpose and whose OUT has a default name."""
    p = argparse.ArgumentParser(description=doc.strip().splitlines()[0])
    p.add_argument("out", nargs="?", default=out_default, help=f"JSON file to write (default: {out_default})")
    return p


def row_numbers(text):
    """Official row numbers from "1,2,7"."""
    return [int(n) for n in text.split(",") if n.strip()]


def official(number):
    """Official row `number` (shapes/official.yaml), as the pipeline reads it."""
    rows = official_rows()
    if number not in rows:
        raise SystemExit(f"official row {number}: no such row (shapes/official.yaml has rows {sorted(rows)})")
    return rows[number]


def contract(row_id):
    """A row of shapes/contract.yaml by its id."""
    rows = {r["id"]: r for r in load_manifest(ROOT / "shapes" / "contract.yaml")}
    if row_id not in rows:
        raise SystemExit(f"{row_id}: no such row in shapes/contract.yaml")
    return rows[row_id]


def named_row(name):
    """`official-NN` (shapes/official.yaml) or a contract row's id (shapes/contract.yaml)."""
    return official(int(name[len("official-"):])) if name.startswith("official-") else contract(name)


def row(row_id, **fields):
    """A row that is in no manifest, with the manifest schema's defaults filled in."""
    return normalize_row({"id": row_id, **fields})


def setup(shape_row, device, disable=(), route=None, reference=True):
    """(config, reference or None, optimized, x, mask): the row's two models on the pipeline's weights and the
    inputs of its first accuracy trial (the official call's all-True mask where the row passes one)."""
    if route is not None:
        shape_row = {**shape_row, "route": route}
    config = model_config(shape_row)
    ref, model = build_models(shape_row, config, device, disable,
                              reference_dtype=torch.float32 if reference else None)
    x, mask, _ = make_case(shape_row, config, device, FIRST_TRIAL_SEED)
    set_precision(reference=False)
    return config, ref, model, x, mask


class ReturnsInput:
    """A runner that does no work: what remains of a call is the forward's own path before the runner."""

    uses_weights = True

    def __init__(self, route):
        self.route = route

    def __call__(self, model, x, mask):
        return x


def reference_output(reference, x, mask):
    """The reference's output in full fp32 (TF32 off), the precision the accuracy job compares against."""
    set_precision(reference=True)
    try:
        with torch.inference_mode():
            return reference(x, mask)
    finally:
        set_precision(reference=False)


def accuracy(want, got):
    """Failed elements and errors at each tolerance of model.tolerance."""
    return {name: compare_outputs(want, got, **tol).as_dict() for name, tol in TOLERANCES.items()}


def median_ms(fn, device, calls):
    """Median of `calls` calls, each timed by the timing job's timer (a CUDA event pair per call on a GPU)."""
    return statistics.median(time_calls(fn, device, calls))


def graph_ms(fn, reps):
    """Time of one `fn()` without the host's launch cost: a CUDA graph of 10 back-to-back calls (captured after
    one eager call that compiles and warms), replayed `reps` times; the median replay / 10."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(10):
            fn()
    for _ in range(2):
        graph.replay()
    return median_ms(graph.replay, CUDA, reps) / 10


def alternating_rounds(calls, device, rounds, per_round):
    """{name: [[ms of each call] per round]}: `rounds` rounds, each timing every call of `calls` ({name: fn})
    `per_round` times, back to back in the order given."""
    times = {name: [] for name in calls}
    for _ in range(rounds):
        for name, fn in calls.items():
            times[name].append(time_calls(fn, device, per_round))
    return times


def pooled_median(rounds):
    return statistics.median(t for r in rounds for t in r)


def parse_settings(texts):
    """{name: {(module, attribute): value}} from "fused_layer.ROW_MASK_BRANCH=False,attention.X=4" texts: the
    kernel-module constants a setting changes (modules of shapewise.kernels, values Python literals)."""
    settings = {}
    for text in texts:
        change = {}
        for item in text.split(","):
            target, sep, value = item.partition("=")
            module, dot, attribute = target.strip().rpartition(".")
            if not sep or not dot:
                raise SystemExit(f"setting {text!r}: expected MODULE.NAME=VALUE, e.g. "
                                 "fused_layer.ROW_MASK_BRANCH=False")
            mod = importlib.import_module(f"shapewise.kernels.{module}")
            if not hasattr(mod, attribute):
                raise SystemExit(f"setting {text!r}: shapewise.kernels.{module} has no {attribute}")
            try:
                change[(mod, attribute)] = ast.literal_eval(value.strip())
            except (ValueError, SyntaxError):
                raise SystemExit(f"setting {text!r}: {value.strip()!r} is not a Python literal") from None
        settings[text] = change
    return settings


@contextmanager
def applied(change):
    """The kernel-module constants of one setting in force, restored afterwards."""
    before = {key: getattr(*key) for key in change}
    for (mod, attribute), value in change.items():
        setattr(mod, attribute, value)
    try:
        yield
    finally:
        for (mod, attribute), value in before.items():
            setattr(mod, attribute, value)


def device_name(device):
    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def write_json(path, obj):
    """Write `obj` to `path` (called after every measured item, so a stopped run keeps what it measured)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1) + "\n")


def require_cuda():
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark measures a CUDA GPU, and torch sees none")


def shape_of(number):
    """(batch_size, seq_len, d_model, num_heads, ffn_dim) of official row `number`."""
    r = official(number)
    return tuple(r[k] for k in ("batch_size", "seq_len", "d_model", "num_heads", "ffn_dim"))


def kernel_weights(d, ffn, device):
    """One layer's weights as the per-layer kernels take them (fp16 matrices and biases, fp32 LayerNorm
    parameters), seeded, and the same values in fp32 for the kernels' fp64 references."""
    g = torch.Generator().manual_seed(0)
    w = {"qkv_w": torch.randn(3 * d, d, generator=g) / d**0.5, "qkv_b": 0.1 * torch.randn(3 * d, generator=g),
         "o_w": torch.randn(d, d, generator=g) / d**0.5, "o_b": 0.1 * torch.randn(d, generator=g),
         "in_w": torch.randn(ffn, d, generator=g) / d**0.5, "in_b": 0.1 * torch.randn(ffn, generator=g),
         "out_w": torch.randn(d, ffn, generator=g) / ffn**0.5, "out_b": 0.1 * torch.randn(d, generator=g),
         "n1_w": 1 + 0.1 * torch.randn(d, generator=g), "n1_b": 0.1 * torch.randn(d, generator=g),
         "n2_w": 1 + 0.1 * torch.randn(d, generator=g), "n2_b": 0.1 * torch.randn(d, generator=g)}
    op = {k: (v.half() if not k.startswith("n") else v).to(device) for k, v in w.items()}
    return op, {k: v.float() for k, v in op.items()}  # the reference sees the same fp16-rounded weights
