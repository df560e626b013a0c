"""How much device memory a forward needs and how much this process may use: the one owner of "what fits".

Three parts, used by the optimized model (each forward's streaming decision) and by the pipeline's preflight:
- the estimate: `working_set_bytes` (what one forward allocates on a route besides its input and output; each
  route's module counts its own activations and weight copies), `io_bytes`, `estimate_memory_bytes` (the whole
  forward, for the reference and the preflight) and `chunked_reference_bytes` (the reference's math where its whole
  forward does not fit);
- the budget: `available_bytes` reads what this process may still allocate on a device: CUDA free memory plus
  what PyTorch's caching allocator holds unused, bounded by `torch.cuda.set_per_process_memory_fraction` and by
  the user's cap (`memory_budget_bytes=` of the model, or env `SHAPEWISE_MEMORY_BUDGET_GB`);
- the decision: `plan_chunks` picks how many batch elements one pass may take (a `MemoryPlan`), or raises
  `MemoryBudgetError` when the input and output themselves do not fit.

The estimates are upper bounds (the peak of the eager op sequence, all live tensors counted), not measurements.
"""
from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass

import torch

from ..kernels import OPERAND_DTYPES
from .config import TransformerConfig, parameter_count

BUDGET_ENV = "SHAPEWISE_MEMORY_BUDGET_GB"  # the user's cap, in GB (10^9 bytes): device memory this process may hold
# A streamed forward keeps each chunk's working set under this, even when more memory is free: a chunk this large
# (hundreds of thousands of tokens) keeps the GPU as busy as the whole batch, and a smaller peak leaves room for
# the caller. Shapes whose whole working set stays under it run in one chunk.
CHUNK_WORKSPACE_BYTES = 4 * 2**30
# Part of the available memory never planned for: cuBLAS / Triton workspaces, allocator rounding and fragmentation.
RESERVE_FRACTION = 0.05


class MemoryBudgetError(MemoryError):
    """A forward cannot fit in the memory this process may use: its input and output alone, or those plus the
    working set of a single batch element. Raised before any kernel runs; the message names the shape, the bytes
    needed and the bytes available."""


def element_bytes(dtype) -> int:
    """Bytes of one element of `dtype`."""
    return torch.empty((), dtype=dtype).element_size()


def operand_bytes(precision: str) -> int:
    """Bytes of one matmul operand in operand precision `precision` (kernels.OPERAND_DTYPES)."""
    return element_bytes(OPERAND_DTYPES[precision])


def io_bytes(config, dtype) -> tuple:
    """(input bytes, output bytes) of one forward: x and the output, both `[B, S, d_model]` in `dtype`."""
    cfg = TransformerConfig.from_any(config)
    one = cfg.tokens * cfg.d_model * element_bytes(dtype)
    return one, one


def working_set_bytes(config, dtype, route, sdpa_mask: bool = False, captured: bool = False) -> int:
    """Bytes one forward of `config.batch_size` elements allocates on `route` besides its input and its output.

    `route`: a routing.Route. Its module's `working_set` (routing.route_module) counts the route's own activations at
    their peak and its weight copies. `sdpa_mask`: PyTorch SDPA is given a valid-token mask (route sdpa with a mask,
    or a Triton route whose own attention kernel is switched off), which materializes it as `[B, 1, S, S]`:
    B * S * S * (1 + a) more (the boolean mask broadcast over queries and its additive form, a the attention's
    operand bytes: the input dtype's on the eager routes). `captured`: the route runs as a CUDA graph (graph, or
    fused on CUDA), whose static input and output copies and mask live as long as the capture: 2 * e * d + 1 more
    per token, e the input dtype's bytes.
    """
    from .routing import ROUTE_SPECS, route_module  # deferred: kept out of the reference's sources

    cfg = TransformerConfig.from_any(config)
    e = element_bytes(dtype)
    own = route_module(route.name).working_set(cfg, dtype, route)
    a = operand_bytes(route.precision) if ROUTE_SPECS[route.name].kernels else e
    mask_bytes = cfg.batch_size * cfg.seq_len * cfg.seq_len * (1 + a) if sdpa_mask else 0
    statics = cfg.tokens * (2 * cfg.d_model * e + 1) if captured else 0
    return int(own + mask_bytes + statics)


# The route each model's estimate takes: the reference's own forward (route_reference.py: the explicit attention's
# `[B, H, S, S]` tensors), or the optimized model's general route (Triton kernels, unmasked, unchunked).
_ESTIMATE_ROUTES = {"reference": "reference", "optimized": "triton"}


def estimate_memory_bytes(config, dtype: torch.dtype, which: str) -> int:
    """Peak device memory estimate (bytes) of one whole forward of the model `which`, "reference" or "optimized":
    weights, input, output and the working set of its route (_ESTIMATE_ROUTES) in the operand precision the
    policy gives the input dtype; for the optimized model what it needs without streaming."""
    if which not in _ESTIMATE_ROUTES:
        raise ValueError(f"estimate_memory_bytes: which must be 'reference' or 'optimized', got {which!r}")
    from .routing import Route, _dtype_name, _precision_for  # deferred: as in working_set_bytes

    cfg = TransformerConfig.from_any(config)
    name = _ESTIMATE_ROUTES[which]
    route = Route(name, _precision_for(name, _dtype_name(dtype), cfg), "estimate")
    weights = parameter_count(cfg.d_model, cfg.ffn_dim, cfg.num_layers) * element_bytes(dtype)
    return int(weights + sum(io_bytes(cfg, dtype)) + working_set_bytes(cfg, dtype, route))


def chunked_reference_bytes(config, batch_elements: int, query_block: int) -> int:
    """Peak bytes `chunked.chunked_reference_forward` allocates on `batch_elements` sampled elements of the input,
    besides the input itself, in float32: the sampled input and its output, its float32 weight copies, eight
    `[b, S, d]` activations (h, n1, q, k, v, the attention's output, the out-projection's, the residual), the FFN's
    two `[b, S, ffn]`, and two score blocks `[b, H, query_block, S]` (scores and probabilities) with the causal
    block's boolean mask."""
    cfg = TransformerConfig.from_any(config)
    b, S = int(batch_elements), cfg.seq_len
    block = min(int(query_block), S)
    activations = b * S * (10 * cfg.d_model + 2 * cfg.ffn_dim) * 4
    scores = 2 * b * cfg.num_heads * block * S * 4 + block * S
    return int(parameter_count(cfg.d_model, cfg.ffn_dim, cfg.num_layers) * 4 + activations + scores)


# ---------------------------------------------------------------------------------------------------------------
# The budget: what this process may still allocate
# ---------------------------------------------------------------------------------------------------------------
def user_budget_bytes(value=None):
    """The user's cap on the device memory this process may hold, in bytes, or None: `value` (the model's
    `memory_budget_bytes=` argument) when given, else env SHAPEWISE_MEMORY_BUDGET_GB (GB = 10^9 bytes)."""
    if value is not None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"memory_budget_bytes must be a positive number of bytes, got {value!r}")
        return int(value)
    text = os.environ.get(BUDGET_ENV, "").strip()
    if not text:
        return None
    try:
        gb = float(text)
    except ValueError:
        raise ValueError(f"{BUDGET_ENV}={text!r}: expected a positive number of GB (10^9 bytes)") from None
    if not (gb > 0 and math.isfinite(gb)):
        raise ValueError(f"{BUDGET_ENV}={text!r}: expected a positive number of GB (10^9 bytes)")
    return int(gb * 1e9)


_get_fraction = getattr(torch._C, "_cuda_getMemoryFraction", None)  # the public reader's C call, without its checks


def memory_fraction(device):
    """The fraction set by torch.cuda.set_per_process_memory_fraction on a CUDA `device` (1.0 when unset), None
    on any other device. Read on every forward (it keys the model's cached plans): one C call."""
    if not isinstance(device, torch.device):
        device = torch.device(device)
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    if _get_fraction is not None:
        return _get_fraction(index)
    return float(torch.cuda.get_per_process_memory_fraction(index))


def available_bytes(device, user_cap=None) -> tuple:
    """(bytes this process may still allocate on `device`, where the number comes from), or (None, why) when
    nothing bounds it.

    CUDA: free device memory (cudaMemGetInfo) plus what PyTorch's caching allocator reserved but does not use;
    with a per-process memory fraction, at most total * fraction - allocated; with the user's cap, at most
    cap - allocated. CPU and other devices: the user's cap when set (nothing is subtracted), else unbounded.
    """
    device = torch.device(device)
    limits = []
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        free, total = torch.cuda.mem_get_info(index)
        reserved, allocated = torch.cuda.memory_reserved(index), torch.cuda.memory_allocated(index)
        limits.append((free + reserved - allocated, f"free {free} + cached {reserved - allocated} bytes on cuda:{index}"))
        fraction = memory_fraction(device)
        if fraction < 1.0:
            limits.append((int(total * fraction) - allocated,
                           f"per-process memory fraction {fraction:g} of {total} bytes, {allocated} allocated"))
        if user_cap is not None:
            limits.append((user_cap - allocated, f"memory budget {user_cap} bytes, {allocated} allocated"))
    elif user_cap is not None:
        limits.append((user_cap, f"memory budget {user_cap} bytes"))
    if not limits:
        return None, f"{device.type}: no memory budget (set {BUDGET_ENV} or memory_budget_bytes= to stream)"
    value, source = min(limits, key=lambda item: item[0])
    return max(0, int(value)), source


# ---------------------------------------------------------------------------------------------------------------
# The decision
# ---------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MemoryPlan:
    """How one forward uses memory: `num_chunks` passes of at most `chunk_size` batch elements.

    `estimate_bytes`: what the plan allocates at its peak (output, the largest chunk's working set and its own
    output, plus the input when it is not yet resident); `unchunked_bytes`: the same for one pass over the whole
    batch; `available_bytes`: the budget it was planned against (None: unbounded); `routes`: the route of the
    first chunk, and of the last one when its size routes it elsewhere.
    """
    shape: tuple
    batch_size: int
    chunk_size: int
    num_chunks: int
    estimate_bytes: int
    unchunked_bytes: int
    input_bytes: int
    output_bytes: int
    available_bytes: int | None
    budget_source: str
    routes: tuple
    reason: str

    @property
    def streamed(self) -> bool:
        return self.num_chunks > 1

    def chunks(self):
        """(start, stop) batch ranges of the passes, in order."""
        return [(s, min(self.batch_size, s + self.chunk_size)) for s in range(0, self.batch_size, self.chunk_size)]

    def as_dict(self) -> dict:
        return {**asdict(self), "shape": list(self.shape), "routes": list(self.routes)}


def _gb(n) -> str:
    """A byte count for a message: GB (10^9) or MB (10^6) with two decimals, else bytes."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} bytes"


def _nbytes(n) -> str:
    """An exact byte count, with its GB / MB reading when that is shorter to grasp."""
    short = _gb(n)
    return f"{int(n)} bytes" + ("" if short.endswith("bytes") else f" ({short})")


def plan_chunks(shape, dtype, input_bytes: int, output_bytes: int, working_set, available, budget_source: str,
                resident_input: bool = True, workspace_bytes: int = CHUNK_WORKSPACE_BYTES):
    """The largest chunk of batch elements (of x's `shape` = (B, S, d_model) in `dtype`) whose pass fits.

    `working_set(b)` -> (bytes, route string): what a pass over `b` elements allocates besides input and output,
    on the route that pass would take. `available`: bytes this process may still allocate (None: unbounded, one
    pass). `resident_input`: the input is already allocated (a forward); False for a plan made before the input
    exists (the preflight). Each pass also allocates its own output before it is copied into the full output.
    A chunk's working set stays under `workspace_bytes` when one element's does; otherwise chunks of one element
    run if they fit at all. Raises MemoryBudgetError when the input and output, or those and a single element's
    pass, do not fit.
    """
    B = int(shape[0])
    name = f"x {list(shape)} {str(dtype).replace('torch.', '')}"
    fixed = output_bytes + (0 if resident_input else input_bytes)
    seen = {}

    def pass_bytes(b):
        if b not in seen:
            work, route = working_set(b)
            chunk_out = 0 if b == B else -(-output_bytes * b // B)
            seen[b] = (work + chunk_out, route)
        return seen[b]

    whole, whole_route = pass_bytes(B)
    common = {"shape": tuple(shape), "batch_size": B, "input_bytes": input_bytes, "output_bytes": output_bytes,
              "available_bytes": available, "budget_source": budget_source, "unchunked_bytes": fixed + whole}
    if available is None:
        return MemoryPlan(chunk_size=B, num_chunks=1, estimate_bytes=fixed + whole, routes=(whole_route,),
                          reason=budget_source, **common)
    usable = int(available * (1 - RESERVE_FRACTION))
    io_text = (f"beside its input ({_nbytes(input_bytes)}, already on the device) its output needs {_nbytes(fixed)}"
               if resident_input else f"its input and output need {_nbytes(fixed)}")
    available_text = f"only {_nbytes(usable)} are available ({budget_source}, less a {RESERVE_FRACTION:.0%} reserve)"
    if fixed > usable:
        raise MemoryBudgetError(f"forward of {name}: {io_text}, but {available_text}")
    room = usable - fixed
    if whole <= min(room, workspace_bytes):
        return MemoryPlan(chunk_size=B, num_chunks=1, estimate_bytes=fixed + whole, routes=(whole_route,),
                          reason=f"one pass: working set {_gb(whole)} within {_gb(min(room, workspace_bytes))}",
                          **common)
    one, _ = pass_bytes(1)
    if one > room:
        raise MemoryBudgetError(f"forward of {name}: {io_text} and a pass over one batch element {_nbytes(one)} "
                                f"more ({_nbytes(fixed + one)} in all), but {available_text}")
    limit = min(room, workspace_bytes) if one <= workspace_bytes else room
    # candidate chunk sizes: ceil(B / n) for n = 2, 3, ...; largest first, each tried once
    chunk, n = 1, 2
    while True:
        c = -(-B // n)
        if c <= 1:
            break
        if pass_bytes(c)[0] <= limit:
            chunk = c
            break
        n = -(-B // (c - 1))
    num = -(-B // chunk)
    routes = [pass_bytes(chunk)[1]]
    last = B - chunk * (num - 1)
    if last != chunk and pass_bytes(last)[1] != routes[0]:
        routes.append(pass_bytes(last)[1])
    peak = fixed + max(pass_bytes(chunk)[0], pass_bytes(last)[0])
    why = (f"above the chunk workspace target {_gb(workspace_bytes)}" if whole <= room
           else f"more than the {_gb(room)} left beside the output")
    return MemoryPlan(chunk_size=chunk, num_chunks=num, estimate_bytes=peak, routes=tuple(routes),
                      reason=f"streamed in {num} chunks of {chunk}: one pass over all {B} would need {_gb(whole)}, "
                             f"{why}", **common)
