"""Which path serves a forward: one pure function, `select_route`, the policy data it reads, and the table of routes.

Routes (ROUTE_SPECS: each route's module, which runs it, and what it needs):
- `reference`: the contract's own math in PyTorch (explicit scores). Serves anything the reference serves.
- `sdpa`: packed QKV + `torch.nn.functional.scaled_dot_product_attention`, eager. CPU and CUDA.
- `triton`: our Triton kernels (flash attention, fused residual + LayerNorm) with cuBLAS GEMMs, eager.
  On a CPU it runs under `TRITON_INTERPRET=1` (slow: for tests).
- `graph`: the `triton` route captured once per input signature in a CUDA graph and replayed. CUDA only.
- `fused`: one Triton kernel per layer (kernels/fused_layer.py) where a sequence fits on chip (the kernel's
  `why_unsupported` says where), fp16/bf16 operands; captured in a CUDA graph on CUDA.
- `hopper`: the whole forward in one Gluon kernel (kernels/hopper_forward.py: wgmma, a TMA weight ring, the
  residual stream in registers), one program per sequence, on sm_90 only, where the policy's `hopper` entry covers
  the shape (`max_seq_len`, `min_batch`, `max_heads`; `max_seq_len` null: never unasked), fp16 operands; captured
  in a CUDA graph, or launched eagerly where `eager_min_batch` covers the batch (one prepared launch a call: no
  output copy); two programs a causal sequence where `pair_max_batch` covers the batch and `pair_max_head_dim`
  the head width; a causal sequence's halves as two warpgroups of one program where `duo_max_head_dim` covers the
  head width (in place of the pair).

Operand precision (`Route.precision`; accumulation is fp32 always, and the kernel routes keep an fp32 residual
stream and fp32 LayerNorm statistics): `reference` and `sdpa` run PyTorch in the input dtype. The kernel routes
take it from the policy: `low_precision_operands` per float16/bfloat16 input (bfloat16 inputs get fp16 operands:
bf16's 8 mantissa bits failed the accuracy contract), `fp32_precision` for float32 inputs. The output is in the
input dtype on every route. fp16 operands for an input that is not float16 can overflow on out-of-range weights:
the model checks its weights (model/weights.py, FP16_SAFE_ABS) and falls back to bf16 operands.

The `triton` and `graph` routes run a layer as our attention between cuBLAS GEMMs and fused residual+LayerNorm
passes, or, where the policy's `split_layer.max_d_model` covers d_model (null: never) and the input has at least
`split_layer.min_tokens` tokens (null: any), as the split layer: three kernels per layer (LayerNorm 1 + QKV, our
attention, kernels/layer_tail.py for the rest), `Route.split_layer`.

The policy (thresholds and precisions) lives in `routing_policy.json` (model/policy.py reads it), read off the
H200 accuracy and ablation tables; `select_route` itself is pure: same inputs, same Route. What a route is
(`Route`, `RouteUnavailable`, the hooks of a route's module) is model/route.py's.
"""
from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, replace

from .config import TransformerConfig
from .policy import POLICY, attention_without_hopper
from .route import Route, RouteModule, RouteUnavailable


@dataclass(frozen=True)
class RouteSpec:
    """What a route is, beside the policy that picks it. `module`: model/<module>.py runs it (see `route_module`)."""
    module: str
    kernels: bool = False  # runs our Triton kernels: KERNEL_DTYPES, head_dim <= MAX_HEAD_DIM, CUDA or the interpreter
    cuda_only: bool = False  # CUDA only, even under TRITON_INTERPRET=1
    captured: bool = False  # on CUDA, captured once per input signature in a CUDA graph and replayed
    pdl: bool = False  # its kernels after a forward's first can launch early and wait in-kernel (kernels/pdl.py)
    sm: int | None = None  # the one CUDA compute capability major its kernels are built for (None: any)


# The routes, in the order the docs list them: adding one is a module and an entry here (and, for `select_route`
# to pick it unasked, a rule below).
ROUTE_SPECS = {
    "reference": RouteSpec("route_reference"),
    "sdpa": RouteSpec("route_sdpa"),
    "triton": RouteSpec("route_triton", kernels=True, pdl=True),
    "graph": RouteSpec("route_triton", kernels=True, cuda_only=True, captured=True, pdl=True),
    "fused": RouteSpec("route_fused", kernels=True, captured=True, pdl=True),
    "hopper": RouteSpec("route_hopper", kernels=True, cuda_only=True, captured=True, sm=9),
}
ROUTES = tuple(ROUTE_SPECS)
CPU_ROUTES = tuple(n for n, s in ROUTE_SPECS.items() if not s.cuda_only)  # kernel routes only under TRITON_INTERPRET=1
KERNEL_DTYPES = ("float32", "float16", "bfloat16")  # the input dtypes the kernel routes serve
MASK_KINDS = ("none", "prefix", "general")


def route_module(name: str) -> RouteModule:
    """The module that runs route `name`, model/<ROUTE_SPECS[name].module>.py: its hooks are `route.RouteModule`'s
    (and `route.OptionalHooks`' where it needs them). Imported on first use: the route modules import torch, this
    module none (the pipeline reads ROUTES at DAG-build time)."""
    if name not in ROUTE_SPECS:
        raise ValueError(f"unknown route {name!r}; routes are {', '.join(ROUTES)}")
    return importlib.import_module(f"{__package__}.{ROUTE_SPECS[name].module}")


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def _device_type(device) -> str:
    if isinstance(device, str) and ":" not in device:
        return device
    return getattr(device, "type", str(device).split(":")[0])


# The precision of PyTorch's own matmuls in each low-precision dtype: what `reference` and `sdpa` run.
_NATIVE_PRECISION = {"float16": "fp16", "bfloat16": "bf16"}


def _precision_for(name: str, dtype: str, shape: TransformerConfig) -> str:
    if name in ("reference", "sdpa"):  # PyTorch in the input dtype (exact fp32 for float32 inputs)
        return _NATIVE_PRECISION.get(dtype, "fp32")
    if dtype in POLICY["low_precision_operands"]:
        return POLICY["low_precision_operands"][dtype]
    rules = POLICY["fp32_precision"]
    for rule in rules["by_d_model_at_least"]:
        if shape.d_model >= rule["d_model"]:
            return rule["precision"]
    return rules["default"]


def _fused_entry(shape: TransformerConfig) -> dict:
    """The policy's first `fused.launch` entry that covers the shape: batch_size * seq_len up to its
    `max_tokens` and num_heads up to its `max_heads` (each null or absent: no bound)."""
    for entry in POLICY["fused"]["launch"]:
        if ((entry["max_tokens"] is None or shape.tokens <= entry["max_tokens"])
                and (entry.get("max_heads") is None or shape.num_heads <= entry["max_heads"])):
            return entry
    raise ValueError("routing_policy.json: fused.launch has no entry with max_tokens null")


def _launch_of(entry: dict) -> tuple:
    return (entry["block_m"], entry["num_warps"], entry["num_stages"])


def _fused_route(name: str, precision: str, reason: str, shape: TransformerConfig, forced: bool = False) -> Route:
    entry = _fused_entry(shape)  # one lookup gives the launch, kv_precompute and the block sizes
    return Route(name, precision, reason, forced=forced, launch=_launch_of(entry),
                 kv_precompute=bool(entry.get("kv_precompute", False)), key_block=int(entry.get("key_block", 0)),
                 ffn_block=int(entry.get("ffn_block", 0)))


def _fused_pays(shape: TransformerConfig) -> bool:
    """Whether the policy expects the fused route to beat the graph route here: tokens*d_model up to
    `fused.max_tokens_x_d_model`, seq_len*d_model (one sequence's activations, which one program of the fused
    kernel holds) up to `fused.max_seq_len_x_d_model`, batch_size*seq_len in [`fused.min_tokens`,
    `fused.max_tokens`] and at most `fused.max_heads` heads (each null or absent: no bound), as measured."""
    fused = POLICY["fused"]
    lo, hi, heads = fused.get("min_tokens") or 1, fused.get("max_tokens"), fused.get("max_heads")
    per_sequence = fused.get("max_seq_len_x_d_model")
    return (shape.tokens * shape.d_model <= fused["max_tokens_x_d_model"] and shape.tokens >= lo
            and (per_sequence is None or shape.seq_len * shape.d_model <= per_sequence)
            and (hi is None or shape.tokens <= hi) and (heads is None or shape.num_heads <= heads))


def _hopper_pays(shape: TransformerConfig) -> bool:
    """Whether the policy expects the Hopper forward to beat the per-layer routes here: seq_len up to
    `hopper.max_seq_len` (null: never), batch_size at least `hopper.min_batch` (a program runs a sequence's layers
    in a fixed time: a batch that leaves most SMs idle is faster on the per-layer routes) and num_heads up to
    `hopper.max_heads` (each null or absent: no bound)."""
    hopper = POLICY["hopper"]
    most, fewest, heads = hopper["max_seq_len"], hopper.get("min_batch") or 1, hopper.get("max_heads")
    return (most is not None and shape.seq_len <= most and shape.batch_size >= fewest
            and (heads is None or shape.num_heads <= heads))


def _hopper_route(precision: str, reason: str, shape: TransformerConfig, forced: bool = False,
                  allow_duo: bool = True) -> Route:
    """Route `hopper`, captured in a CUDA graph up to the policy's `graph.max_tokens_x_d_model`, launched eagerly
    beyond (its one launch is then a small part of the forward, and the graph's copy of its output out of the
    graph's buffer a large one: row 6, 308 µs of 5.55 ms); through the signature's prepared launch
    (`Route.prepared_launch`, `kernels.hopper_forward.PreparedLaunch`: no output copy, and a launch of the
    compiled kernel where Triton's JIT launch binds every argument again) where `hopper.eager_min_batch` (null or
    absent: never) covers the batch: a kernel long enough to hide the host's launch; that launch calls Triton's C
    launcher with an argument list built once where `hopper.direct_launch` is true (`Route.direct_launch`). Two
    programs a sequence where `hopper.pair_max_batch` (null or absent: never) covers the batch,
    `hopper.pair_max_head_dim` (null or absent: any) the head width, and the kernel's `pair` serves the shape: a
    batch that leaves SMs idle. A loader warp fills the weight ring where `hopper.producer_max_head_dim` (null or
    absent: never) covers the head width: a wider head's math warps need the registers the loader takes. A causal
    sequence's halves run as two warpgroups of one program, with its loader warp, in place of both, where
    `hopper.duo_max_head_dim` (null or absent: never) covers the head width, `allow_duo` holds and the kernel's
    `duo` serves the shape."""
    from shapewise.kernels.hopper_forward import why_unsupported  # deferred: routing imports no torch

    route = Route("hopper", precision, reason, forced=forced)
    hopper = POLICY["hopper"]
    widest_duo = hopper.get("duo_max_head_dim")
    if (allow_duo and widest_duo is not None and shape.head_dim <= widest_duo
            and why_unsupported(shape.seq_len, shape.d_model, shape.num_heads, shape.ffn_dim, causal=shape.causal,
                                duo=True) is None):
        route = replace(route, duo=True, reason=route.reason + (
            f"; a sequence's halves as two warpgroups and a loader warp (head_dim {shape.head_dim} <= {widest_duo})"))
    widest_producer = hopper.get("producer_max_head_dim")
    if not route.duo and widest_producer is not None and shape.head_dim <= widest_producer:
        route = replace(route, producer=True, reason=route.reason + (
            f"; a loader warp fills the weight ring (head_dim {shape.head_dim} <= {widest_producer})"))
    most_pair, widest = hopper.get("pair_max_batch"), hopper.get("pair_max_head_dim")
    if (not route.duo and most_pair is not None and shape.batch_size <= most_pair
            and (widest is None or shape.head_dim <= widest)
            and why_unsupported(shape.seq_len, shape.d_model, shape.num_heads, shape.ffn_dim, causal=shape.causal,
                                pair=True) is None):
        route = replace(route, pair=True, reason=route.reason + (
            f"; two programs a sequence (batch {shape.batch_size} <= {most_pair})"))
    fewest_eager = hopper.get("eager_min_batch")
    if fewest_eager is not None and shape.batch_size >= fewest_eager:
        direct = bool(hopper.get("direct_launch", False))
        return replace(route, eager=True, prepared_launch=True, direct_launch=direct, reason=route.reason + (
            f"; launched eagerly (batch {shape.batch_size} >= {fewest_eager}: a prepared launch, no graph, no "
            f"output copy{', its argument list built once' if direct else ''})"))
    most = POLICY["graph"]["max_tokens_x_d_model"]
    size = shape.tokens * shape.d_model
    if size <= most:
        return route
    return replace(route, eager=True, reason=route.reason + (
        f"; launched eagerly (tokens*d = {size} > {most}: no graph, no output copy)"))


def _with_split_layer(route: Route, shape: TransformerConfig) -> Route:
    """The triton/graph `route` with the split layer where the policy's `split_layer.max_d_model` (null: never)
    covers d_model, batch_size*seq_len is at least `split_layer.min_tokens` (null or absent: any), the operands
    are fp16/bf16 and the attention is our kernel; else `route` itself."""
    from shapewise.kernels.layer_tail import why_unsupported as tail_unsupported  # deferred: routing imports no torch

    split = POLICY["split_layer"]
    most, fewest = split["max_d_model"], split.get("min_tokens") or 1
    if (route.name not in ("triton", "graph") or most is None or shape.d_model > most or shape.tokens < fewest
            or route.attention != "triton" or route.precision not in ("fp16", "bf16")
            or tail_unsupported(shape.d_model)):
        return route
    return replace(route, split_layer=True,
                   reason=route.reason + f"; split layer (d_model <= {most}, tokens >= {fewest})")


def _with_hopper_linear(route: Route, shape: TransformerConfig, capability) -> Route:
    """The triton/graph `route` with the Hopper linear layers (kernels/linear_hopper.py) where the policy's
    `hopper_linear.min_d_model` (null: never) covers d_model, on sm_90, with fp16/bf16 operands and no split layer
    (which has its own tail); else `route` itself."""
    least = POLICY["hopper_linear"]["min_d_model"]
    if (route.name not in ("triton", "graph") or route.split_layer or least is None or shape.d_model < least
            or capability is None or capability[0] != 9 or route.precision not in ("fp16", "bf16")
            or shape.d_model % 8 or shape.ffn_dim % 8):  # TMA: 16-byte rows
        return route
    return replace(route, hopper_linear=True, reason=route.reason + (
        f"; Hopper linear layers, GELU in FFN-in's epilogue (d_model >= {least}, sm_90)"))


def _with_hopper_kernels(route: Route, shape: TransformerConfig, capability) -> Route:
    """The triton/graph `route` with the Hopper linear layers and the split layer's Hopper kernels where the policy
    says so (`_with_hopper_linear`, `_with_hopper_split`)."""
    return _with_hopper_split(_with_hopper_linear(route, shape, capability), shape, capability)


def _with_hopper_split(route: Route, shape: TransformerConfig, capability) -> Route:
    """The split-layer `route` with its layers' tails as kernels/layer_tail_hopper.py, and its LayerNorm 1 + QKV as
    kernels/ln_qkv_hopper.py, each where the policy's `split_layer.hopper_tail_min_tokens` or
    `hopper_ln_qkv_min_tokens` (absent or null: never) covers batch_size*seq_len, on sm_90, at widths the kernel
    serves; else `route` itself."""
    if not route.split_layer or capability is None or capability[0] != 9:
        return route
    from shapewise.kernels import layer_tail_hopper, ln_qkv_hopper  # deferred: routing imports no torch

    policy = POLICY["split_layer"]
    for field, key, why, what in (
            ("hopper_tail", "hopper_tail_min_tokens", layer_tail_hopper.why_unsupported(shape.d_model, shape.ffn_dim),
             "Hopper layer tail"),
            ("hopper_ln_qkv", "hopper_ln_qkv_min_tokens", ln_qkv_hopper.why_unsupported(shape.d_model),
             "Hopper LayerNorm + QKV")):
        least = policy.get(key)
        if least is not None and shape.tokens >= least and why is None:
            route = replace(route, **{field: True}, reason=route.reason + (
                f"; {what}: weights once per SM (tokens >= {least}, sm_90)"))
    return route


def _with_eager_tail(route: Route, shape: TransformerConfig) -> Route:
    """The graph `route` with its last kernel launched after the replay into a new output, where the policy's
    `graph.eager_tail_min_tokens_x_d_model` (absent or null: never) covers tokens*d_model: there the copy of the
    output out of the graph's buffer costs the GPU more than one launch costs the host, which the GPU's time
    hides; else `route` itself."""
    least = POLICY["graph"].get("eager_tail_min_tokens_x_d_model")
    size = shape.tokens * shape.d_model
    if route.name != "graph" or least is None or size < least:
        return route
    return replace(route, eager_tail=True, reason=route.reason + (
        f"; its last kernel after the replay, into a new output (tokens*d = {size} >= {least})"))


def with_pdl(route: Route, capability) -> Route:
    """`route` with programmatic dependent launch where its kernels take it (RouteSpec.pdl) and the CUDA device's
    compute capability (a (major, minor) pair; None: no CUDA device) is at least the policy's `pdl.min_capability`
    (null: never); else `route` itself."""
    least = POLICY["pdl"]["min_capability"]
    if not ROUTE_SPECS[route.name].pdl or capability is None or least is None or tuple(capability) < tuple(least):
        return route
    return replace(route, pdl=True,
                   reason=route.reason + f"; programmatic dependent launch (sm_{least[0]}{least[1]}+)")


def why_unavailable(name: str, shape: TransformerConfig, dtype, device, interpret: bool, capability=None) -> str | None:
    """Why route `name` cannot serve this input, or None if it can. `capability`: the CUDA device's (major,
    minor), asked of the device where None and the route is built for one (RouteSpec.sm)."""
    dev, dt = _device_type(device), _dtype_name(dtype)
    if name not in ROUTES:
        return f"unknown route {name!r}; routes are {', '.join(ROUTES)}"
    spec = ROUTE_SPECS[name]
    if not spec.kernels:
        return None
    if dt not in KERNEL_DTYPES:
        return f"route {name!r} serves {'/'.join(KERNEL_DTYPES)}, not {dt}"
    from shapewise.kernels.attention import MAX_HEAD_DIM  # deferred: routing imports no torch

    if shape.head_dim > MAX_HEAD_DIM:
        return f"route {name!r} serves head_dim <= {MAX_HEAD_DIM}, got {shape.head_dim}"
    if spec.cuda_only and dev != "cuda":
        return f"route {name!r} needs a CUDA device, got {dev}"
    if dev != "cuda" and not (dev == "cpu" and interpret):
        return f"route {name!r} needs a CUDA device, or TRITON_INTERPRET=1 on the CPU (device {dev})"
    if spec.sm is not None:
        if capability is None:
            import torch  # deferred: routing imports no torch (the pipeline reads ROUTES at DAG-build time)

            capability = torch.cuda.get_device_capability(device)
        if capability[0] != spec.sm:
            return (f"route {name!r} runs on compute capability {spec.sm}.x (sm_{spec.sm}0) only, got "
                    f"{capability[0]}.{capability[1]}")
    limits = getattr(route_module(name), "why_unsupported", None)
    why = limits(shape) if limits is not None else None
    if why:
        return f"route {name!r}: {why}"
    return None


def select_route(shape: TransformerConfig, dtype, device, mask_kind: str = "none", forced: str | None = None,
                 interpret: bool | None = None, allow_fused: bool = True, allow_hopper: bool = True,
                 allow_duo: bool = True, capability=None) -> Route:
    """Pick the route for one input signature. Pure: reads only its arguments and the policy data.

    `forced` (a route name, or None/"auto") is honoured or refused with RouteUnavailable, never replaced.
    `capability`: the CUDA device's (major, minor) compute capability (None: no route built for one capability is
    picked unasked; a forced one asks the device).
    """
    if mask_kind not in MASK_KINDS:
        raise ValueError(f"mask_kind must be one of {MASK_KINDS}, got {mask_kind!r}")
    if interpret is None:
        interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"
    dt = _dtype_name(dtype)
    if forced not in (None, "auto"):
        if forced not in ROUTES:
            raise ValueError(f"unknown route {forced!r}; choose one of auto, {', '.join(ROUTES)}")
        why = why_unavailable(forced, shape, dtype, device, interpret, capability)
        if why:
            raise RouteUnavailable(why)
        if forced == "fused":
            return _fused_route("fused", _precision_for(forced, dt, shape), "forced by the caller", shape, forced=True)
        if forced == "hopper":
            return _hopper_route(_precision_for(forced, dt, shape), "forced by the caller", shape, forced=True,
                                 allow_duo=allow_duo)
        route = _with_split_layer(Route(forced, _precision_for(forced, dt, shape), "forced by the caller",
                                        forced=True), shape)
        return _with_eager_tail(_with_hopper_kernels(route, shape, capability), shape)

    dev = _device_type(device)
    if dev != "cuda":
        return Route("sdpa", _precision_for("sdpa", dt, shape), f"{dev}: eager PyTorch path")
    if why_unavailable("triton", shape, dtype, device, interpret):
        return Route("sdpa", _precision_for("sdpa", dt, shape), "outside the Triton kernels' range")
    size = shape.tokens * shape.d_model
    if (allow_hopper and capability is not None and _hopper_pays(shape)
            and _precision_for("hopper", dt, shape) == "fp16"
            and not why_unavailable("hopper", shape, dtype, device, interpret, capability)):
        return _hopper_route("fp16", f"one sequence's residual stream in registers: the whole forward in one Gluon "
                                     f"kernel (seq_len {shape.seq_len} <= {POLICY['hopper']['max_seq_len']})", shape,
                             allow_duo=allow_duo)
    if allow_fused and _fused_pays(shape) and not why_unavailable("fused", shape, dtype, device, interpret):
        return _fused_route("fused", _precision_for("fused", dt, shape),
                            f"short, narrow, launch-bound shape: one kernel per layer (tokens*d = {size})", shape)
    graph = POLICY["graph"]
    if shape.tokens * shape.d_model <= graph["max_tokens_x_d_model"]:
        route = _with_split_layer(Route(
            "graph", _precision_for("graph", dt, shape),
            f"launch-bound (tokens*d = {shape.tokens * shape.d_model} <= {graph['max_tokens_x_d_model']})"), shape)
        return _with_eager_tail(_with_hopper_kernels(route, shape, capability), shape)
    route = Route("triton", _precision_for("triton", dt, shape),
                  f"compute/memory-bound (tokens*d = {shape.tokens * shape.d_model})")
    how = "" if mask_kind == "none" else " (causal prefix masks; other masks: our kernel, decided per call)"
    hopper_from = POLICY["attention"].get("hopper_from_seq_len")
    if _hopper_attention_pays(shape, route.precision, capability, hopper_from):
        route = replace(route, attention="hopper",
                        reason=route.reason + f"; Hopper attention (Gluon) from seq_len {hopper_from}{how}")
    elif attention_without_hopper(shape.seq_len) == "sdpa":
        route = replace(route, attention="sdpa", reason=route.reason + (
            f"; SDPA attention from seq_len {POLICY['attention']['sdpa_from_seq_len']}{how}"))
    return _with_hopper_kernels(_with_split_layer(route, shape), shape, capability)


def _hopper_attention_pays(shape: TransformerConfig, precision: str, capability, hopper_from) -> bool:
    """The policy's `attention.hopper_from_seq_len` (null: never) covers seq_len, on sm_90, with fp16 operands and a
    head dim the kernel serves."""
    if (hopper_from is None or shape.seq_len < hopper_from or capability is None or capability[0] != 9
            or precision != "fp16"):
        return False
    from shapewise.kernels.attention_hopper import why_unsupported  # deferred: routing imports no torch

    return why_unsupported(shape.head_dim) is None
