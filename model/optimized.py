"""`UserOptimizedTransformer`: the reference's drop-in, routed per input signature to the fastest correct path.

Same constructor, same `forward(x, valid_token_mask=None)`, same parameter names (it *is* a
`BaselineTransformer` with other forward paths), so `load_state_dict(reference.state_dict(), strict=True)`
works. `forward` validates the input, plans its memory (model/streamed.py), picks the route of its input signature
(model/routing.py, then the switches and the fp16 screen here) and runs that route's runner: each route's kernel
sequence lives in its own module (routing.ROUTE_SPECS names it) with the state it needs, derived weights
(model/weights.py) and, on CUDA, captured graphs (model/captured.py).

Autograd (docs/decisions.md#autograd-reference-route): the routes are inference only. A call with grad mode on and an x
that requires grad, or on a training model forced to route `reference`, runs the reference computation, which autograd
records. A training model's other calls with grad mode on take the routes, and their output's backward raises, naming
the route and what to do; in eval(), under no_grad or inference_mode the output carries no gradient.

Derived weights (packed QKV, operand-precision copies) are cached as plain attributes, never registered, and
refreshed in place when their parameters change: model/weights.py says which edits are seen and which need
`refresh_weights()`.

Operand precision: the route's (model/routing.py). Where that is fp16 for an input that is not float16 (float32
inputs, and bfloat16 inputs, whose bf16 weights convert to fp16 exactly within fp16's range), the model checks
once per weight version that every parameter lies within FP16_SAFE_ABS, and runs bf16 operands (fp32's range)
where one does not; the route's reason names the parameter. A `precision=` set by the caller is not checked.
"""
from __future__ import annotations

import os
import threading
from dataclasses import replace

import torch

from ..kernels import OPERAND_DTYPES as _OPERAND_DTYPE
from . import streamed
from .captured import MAX_GRAPHS, CapturedForward, Captures
from .config import TransformerConfig
from .memory import available_bytes, memory_fraction, user_budget_bytes
from .reference import BaselineTransformer, check_inputs, check_parameters_match
from .routing import KERNEL_DTYPES, ROUTE_SPECS, ROUTES, RouteUnavailable, route_module, select_route, with_pdl
from .weights import FP16_SAFE_ABS, DerivedWeights, share_one_counter

# Ablation switches: each can be turned off alone (constructor `disable=` or env SHAPEWISE_DISABLE).
OPTIMIZATIONS = (
    "fused_layer",  # a whole layer per Triton kernel for short, narrow shapes (off: one kernel per op)
    "cuda_graph",  # replay a captured CUDA graph per input signature (off: launch every kernel eagerly)
    "reduced_precision",  # tensor-core operand precision from the routing policy (off: exact fp32 operands)
    "flash_attention",  # our Triton flash attention (off: PyTorch SDPA inside the same route)
    "fused_layernorm",  # our Triton residual add + LayerNorm (off: separate PyTorch add and layer_norm)
    "packed_qkv",  # one QKV GEMM over a packed weight (off: three GEMMs)
    "eager_tail",  # where the policy says so: the graph route's last kernel launched after the replay into a new
    # output (off: captured, its output copied out of the graph's buffer)
    "direct_input",  # a captured graph reads the caller's x and mask in place once their addresses repeat (off: copy in)
    "split_layer",  # where the policy says so: a layer as LN+QKV, our attention and one tail kernel (off: unfused)
    "pdl",  # on sm_90+: a forward's kernels after its first launch early and wait in-kernel (off: each launches when
    # the one before it has finished)
    "hopper_forward",  # where the policy says so, on sm_90: the whole forward in one Gluon kernel (off: the per-layer
    # routes)
    "hopper_pair",  # where the policy says so: the Hopper forward with two programs a causal sequence (off: one)
    "hopper_producer",  # where the policy says so: the Hopper forward's weight ring filled by a loader warp (off: by
    # the math warps)
    "hopper_duo",  # where the policy says so: the Hopper forward with a causal sequence's halves as two warpgroups of
    # one program (off: the pair and loader warp the policy gives without it)
    "hopper_attention",  # where the policy says so, on sm_90: the triton route's attention as kernels.attention_hopper
    # (off: the attention the policy gives without it, SDPA at these lengths)
    "hopper_linear",  # where the policy says so, on sm_90: the triton/graph routes' out-projection and FFN as
    # kernels.linear_hopper, the GELU in FFN-in's epilogue (off: cuBLAS GEMMs and a GELU pass)
    "hopper_tail",  # where the policy says so, on sm_90: the split layer's tail as kernels.layer_tail_hopper, its
    # weights once per SM (off: the Triton tail)
    "hopper_ln_qkv",  # where the policy says so, on sm_90: the split layer's LayerNorm 1 + QKV as
    # kernels.ln_qkv_hopper, its weight once per SM (off: the Triton kernel)
)
MAX_MEMORY_PLANS = 64  # memory plans a model keeps (one per input signature, cap and memory fraction)
_grad_enabled = torch.is_grad_enabled  # read on every call: a module attribute's lookup costs it ~0.05 µs more
# The current CUDA stream's handle, an int: one C call (`torch.cuda.current_stream` builds an object, ~10x as long)
_stream_handle = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
    lambda index: torch.cuda.current_stream(index).cuda_stream)


def switches_used(route, input_dtype, device_type: str) -> tuple:
    """The OPTIMIZATIONS that shape what `route` runs for inputs of `input_dtype` on `device_type`.

    Switching off any other one runs the very same code: the ablation job records those as not applicable
    instead of timing the same thing twice.
    """
    spec = ROUTE_SPECS[route.name]
    if not spec.kernels:
        return ()
    used = set(route_module(route.name).switches(route))
    if input_dtype == torch.float32:
        used.add("reduced_precision")
    if spec.captured and not route.eager and (spec.cuda_only or device_type == "cuda"):
        used.update(("cuda_graph", "direct_input"))
    if route.pdl:
        used.add("pdl")
    return tuple(name for name in OPTIMIZATIONS if name in used)


# The dtypes the routes serve, as the dtype error ends
_SUPPORTED = (f"Supported: {', '.join(KERNEL_DTYPES[:-1])} and {KERNEL_DTYPES[-1]} on every route, any other floating "
              f"dtype (float64) on the reference and sdpa routes")


class _InferenceOutput(torch.autograd.Function):
    """The output of a training model's inference route, marked so that a backward through it raises: the route's
    kernels record no gradient, and a training loop must not step on none, silently."""

    @staticmethod
    def forward(ctx, out, anchor, route):
        ctx.route = route
        ctx.mark_dirty(out)  # the output itself gets the node: no view, no copy
        return out

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError(
            f"UserOptimizedTransformer: this output came from the inference route {ctx.route!r}, which records no "
            f"gradient. For gradients to the parameters construct the model with route='reference' (or pass an x "
            f"that requires grad: the reference computation then serves); for inference call model.eval() or run "
            f"under torch.no_grad() or torch.inference_mode()")


def _refuse_backward(model, out):
    """`out`, marked so that a backward through it raises (_InferenceOutput), where a parameter requires grad."""
    anchor = next((p for p in model.parameters() if p.requires_grad), None)
    if anchor is None:  # nothing to train: no gradient is missing
        return out
    return _InferenceOutput.apply(out, anchor, str(model.last_route.name))


class UserOptimizedTransformer(BaselineTransformer):
    def __init__(self, config, route: str = "auto", disable=(), precision: str | None = None,
                 memory_budget_bytes: int | None = None):
        super().__init__(TransformerConfig.from_any(config))
        share_one_counter(self)  # the per-call weight check reads one counter (model/weights.py)
        if route == "auto":  # an explicit constructor argument wins over the environment
            route = os.environ.get("SHAPEWISE_ROUTE", "").strip() or "auto"
        if route != "auto" and route not in ROUTES:
            raise ValueError(f"UserOptimizedTransformer: unknown route {route!r}; choose auto or one of {ROUTES}")
        env_disable = [s.strip() for s in os.environ.get("SHAPEWISE_DISABLE", "").split(",") if s.strip()]
        disabled = frozenset(disable) | frozenset(env_disable)
        unknown = sorted(disabled - set(OPTIMIZATIONS))
        if unknown:
            raise ValueError(f"UserOptimizedTransformer: unknown optimization(s) {unknown}; known: {OPTIMIZATIONS}")
        if precision is not None and precision not in _OPERAND_DTYPE:
            raise ValueError(f"UserOptimizedTransformer: precision must be one of {tuple(_OPERAND_DTYPE)}, "
                             f"got {precision!r}")
        self.route = route
        self.precision = precision  # overrides the policy's operand precision for float32 inputs (not range-checked)
        self.disabled = disabled
        self.last_route = None
        # Memory (model/memory.py): the user's cap on the device memory this process may hold (argument, else env
        # SHAPEWISE_MEMORY_BUDGET_GB, read here once); the plan of each (input signature, cap, memory fraction).
        self.memory_budget_bytes = user_budget_bytes(memory_budget_bytes)
        self.last_memory_plan = None
        self._memory_plans = {}
        self._streaming = False  # inside a streamed forward: each chunk runs as planned, never planned again
        self._chunks_all_valid = False  # inside a streamed forward: its mask is given and every token valid
        self._paths = {}  # input signature -> the runner of its route
        self._known = {}  # a call's full signature -> (its input signature, memory plan, cap, fraction): checked
        self._graphs = Captures()  # the runners that hold captured CUDA graphs
        self._weights = DerivedWeights()  # derived weight tables, their parameters' versions, the fp16 screen
        self._calls = threading.RLock()  # one call at a time: plans, captured buffers and scratch serve every call
        self._stream = None  # (stream, handle, under a capture) of the previous CUDA call (`_follow_stream`)

    def forward(self, x: torch.Tensor, valid_token_mask=None) -> torch.Tensor:
        with self._calls:  # threads take turns (a streamed forward's chunks re-enter from the same thread)
            out = self._forward(x, valid_token_mask)
        if self.training and out.grad_fn is None and _grad_enabled():  # a training model's inference route
            return _refuse_backward(self, out)
        return out

    def _forward(self, x, valid_token_mask):
        mask = valid_token_mask
        try:  # everything check_inputs and the memory plan read of the inputs: a known one needs neither again
            call = (x.__class__, x.shape, x.dtype, x.device,
                    None if mask is None else (mask.__class__, mask.shape, mask.dtype, mask.device))
            known = self._known.get(call)
            # Gradients: recorded only where grad mode is on (under no_grad or inference_mode the calls pay one C
            # call), for an x that requires grad or a training model forced to the reference; read on every call,
            # since the known calls know nothing of grad mode.
            grads = _grad_enabled() and (x.requires_grad or (self.training and self.route == "reference"))
        except (AttributeError, TypeError):  # not tensors: check_inputs names what is wrong
            call = known = None
            grads = False
        if grads:
            why = self._gradients_asked(x)
            if why is not None:
                return self._differentiable_forward(x, mask, why)
        if known is not None and not self._streaming:
            key, plan, cap, fraction = known
            runner = self._paths.get(key)
            if (runner is not None and cap == self.memory_budget_bytes and fraction == memory_fraction(call[3])
                    and not (runner.uses_weights and self._weights.moved(self))):
                _set_plain(self, "last_memory_plan", plan)
                _set_plain(self, "last_route", runner.route)
                return self._run(runner, x, mask)
        return self._checked_forward(x, mask, call)

    def _checked_forward(self, x, mask, call):
        check_inputs(self.config, x, mask)
        key = (x.shape, x.dtype, x.device, mask is None)  # the input signature
        plan = None
        if not self._streaming:  # memory: decided on the signature's first call under this cap and fraction
            cap, fraction = self.memory_budget_bytes, memory_fraction(x.device)
            plan = self._memory_plans.get((key, cap, fraction))
            if plan is None:  # a new signature, or the model converted (.to() forgets the plans)
                self._check_device_and_dtype(x)
                plan = self._plan_memory(key, x, mask)
            _set_plain(self, "last_memory_plan", plan)
            if plan.num_chunks > 1:
                return streamed.forward_streamed(self, x, mask, plan)
        runner = self._paths.get(key)
        if runner is None or runner.uses_weights:
            # Before the route runs: edited weights are derived again here, and edits that move a parameter across
            # FP16_SAFE_ABS drop the routes chosen under the old verdict (this one too: selected again).
            if self._weights.refresh(self):
                self._drop_routes()
            runner = self._paths.get(key)
            if runner is None:
                runner = self._paths[key] = self._runner(x, mask)
        _set_plain(self, "last_route", runner.route)
        if plan is not None and call is not None:  # the next call of this signature skips the checks above
            if len(self._known) >= MAX_MEMORY_PLANS:
                self._known.pop(next(iter(self._known)))
            self._known[call] = (key, plan, cap, fraction)
        return self._run(runner, x, mask)

    def _gradients_asked(self, x):
        """Why this call (grad mode on) must record gradients, or None: x requires grad, or the model is in training
        mode, forced to route `reference`, and a parameter requires grad."""
        if getattr(x, "requires_grad", False):  # a stand-in for a tensor: check_inputs names it
            return "x requires grad"
        if self.training and any(p.requires_grad for p in self.parameters()):
            return "the model is in training mode and its parameters require grad"
        return None

    def _differentiable_forward(self, x, mask, why):
        """The reference computation, which autograd records (the other routes are inference only: no backward of
        their kernels, their derived weights detached), recorded in `last_route` with `why`; a forced route other
        than `reference` is refused rather than replaced (docs/decisions.md#autograd-reference-route)."""
        check_inputs(self.config, x, mask)
        self._check_device_and_dtype(x)
        if self.route not in ("auto", "reference"):
            raise RouteUnavailable(
                f"route {self.route!r} is forced but this call records gradients ({why}, grad enabled): only the "
                f"reference route is differentiable; for route {self.route!r} call model.eval() (with an x that does "
                f"not require grad) or run under torch.no_grad() or torch.inference_mode()")
        cfg = self.config
        shape = TransformerConfig(x.shape[0], x.shape[1], cfg.d_model, cfg.num_heads, cfg.ffn_dim, cfg.num_layers,
                                  cfg.causal)
        route = select_route(shape, x.dtype, x.device, "none" if mask is None else "general", forced="reference")
        reason = f"autograd: {why}; the reference computation is the differentiable route"
        if self.route == "reference":
            reason = f"forced by the caller; {reason}"
        _set_plain(self, "last_memory_plan", None)
        _set_plain(self, "last_route", replace(route, forced=self.route == "reference", reason=reason))
        return BaselineTransformer.forward(self, x, mask)

    def _run(self, runner, x, mask):
        if x.is_cuda:
            handle = _stream_handle(x.get_device())
            if self._stream is None or handle != self._stream[1]:
                self._follow_stream(x.device, handle)
        return runner(self, x, mask)

    def _follow_stream(self, device, handle) -> None:
        """A CUDA call on another stream than the previous one's: this stream waits for what that one queued. The
        captured graphs' static buffers, the program pair's scratch and the derived weights belong to the model and
        serve every call, so its calls run on the GPU in the order they were made, on any streams (no host
        synchronization). A call inside a caller's CUDA-graph capture, or right after one, adds no wait: a capture
        may depend on no work outside it, and its replays are ordered by whoever replays them."""
        stream = torch.cuda.current_stream(device)
        capturing = torch.cuda.is_current_stream_capturing()
        previous = self._stream
        if previous is not None and not (capturing or previous[2]) and previous[0].device == stream.device:
            stream.wait_stream(previous[0])
        _set_plain(self, "_stream", (stream, handle, capturing))

    def _check_device_and_dtype(self, x) -> None:
        """x on the parameters' device and in their dtype, checked on each signature's first call (the signature
        holds both): the reference's rule (reference.check_parameters_match), on every route."""
        check_parameters_match(self, x, _SUPPORTED)

    def _runner(self, x, mask):
        """The runner of this input signature's route: its module's, captured in CUDA graphs where the route is."""
        route = self._select(x, mask)
        runner = route_module(route.name).runner(self, route)
        if self._captured(route, x):
            runner = CapturedForward(runner, self._graphs, "direct_input" not in self.disabled, route.eager_tail)
        return runner

    def _select(self, x, mask):
        """The route of this input signature: the policy's (routing.select_route), under the model's switches,
        the caller's precision and the fp16 screen, then settled by the route's own module."""
        cfg = self.config
        shape = TransformerConfig(x.shape[0], x.shape[1], cfg.d_model, cfg.num_heads, cfg.ffn_dim, cfg.num_layers,
                                  cfg.causal)
        capability = torch.cuda.get_device_capability(x.device) if x.is_cuda else None
        route = select_route(shape, x.dtype, x.device, "none" if mask is None else "general", forced=self.route,
                             allow_fused="fused_layer" not in self.disabled,
                             allow_hopper="hopper_forward" not in self.disabled,
                             allow_duo="hopper_duo" not in self.disabled,
                             capability=capability)
        if not ROUTE_SPECS[route.name].kernels:
            return route
        caller_precision = False
        if x.dtype == torch.float32:
            if "reduced_precision" in self.disabled:
                route = replace(route, precision="fp32", reason=route.reason + "; reduced_precision disabled")
            elif self.precision is not None:
                route = replace(route, precision=self.precision, reason=route.reason + "; precision set by caller")
                caller_precision = True
        if route.precision == "fp16" and x.dtype != torch.float16 and not caller_precision:
            offender, changed = self._weights.fp16_offender(self)  # the weights converted to fp16 (and activations)
            if changed:
                self._drop_routes()
            if offender is not None:
                name, peak = offender
                route = replace(route, precision="bf16", reason=route.reason + (
                    f"; bf16 operands: max |{name}| = {peak:.4g} > FP16_SAFE_ABS = {FP16_SAFE_ABS:g} (fp16 range)"))
        settle = getattr(route_module(route.name), "settle", None)
        route = route if settle is None else settle(route, x, self.disabled)
        if "pdl" in self.disabled or capability is None:
            return route
        return with_pdl(route, capability)

    def _captured(self, route, x) -> bool:
        """Whether `forward` runs this route as captured CUDA graphs for `x` (memory_plan asks the same)."""
        return (ROUTE_SPECS[route.name].captured and not route.eager and x.is_cuda
                and "cuda_graph" not in self.disabled)

    def _drop_routes(self) -> None:
        """Forget every signature's route, runner and captured graphs: each selects its route again."""
        self._paths = {}
        self._known = {}
        self._graphs.clear()

    # -------------------------------------------------------------------------------------------
    # Derived weights (model/weights.py)
    # -------------------------------------------------------------------------------------------
    def refresh_weights(self) -> None:
        """Rebuild the derived weights from the parameters now (after edits PyTorch cannot see), and check them
        against FP16_SAFE_ABS again where a route asked."""
        self._weights.mark_stale()
        if self._weights.refresh(self):
            self._drop_routes()

    def load_state_dict(self, *args, **kwargs):  # assign=True swaps Parameter objects: list them again
        self._weights.relist()
        return super().load_state_dict(*args, **kwargs)

    def __getstate__(self):  # a lock and a stream neither pickle nor copy: a copy makes its own
        state = super().__getstate__()
        state["_calls"], state["_stream"] = None, None
        return state

    def __setstate__(self, state):  # unpickled parameters are plain nn.Parameters: list (and watch) them again
        super().__setstate__(state)
        self._calls = threading.RLock()
        self._chunks_all_valid = False  # set here too: a pickled state may lack it
        self._weights.relist()

    def _apply(self, fn, *args, **kwargs):  # .to(), .cuda(), .half(): derived state is rebuilt lazily
        self._weights.forget()
        self._drop_routes()
        self._memory_plans = {}
        self._stream = None
        return super()._apply(fn, *args, **kwargs)

    # -------------------------------------------------------------------------------------------
    # Memory (model/memory.py decides, model/streamed.py runs the chunks)
    # -------------------------------------------------------------------------------------------
    def memory_plan(self, x, valid_token_mask=None, resident_input: bool = True, available=None):
        """How a forward of `x` (and mask) would use memory: a memory.MemoryPlan (chunk size, number of chunks,
        estimate, budget, why), planned now against the memory this process may allocate (or `available` bytes,
        with its source, when given as a (bytes, source) pair). `resident_input=False`: the input is not yet on the
        device (a plan made ahead, e.g. by the pipeline's preflight). Raises memory.MemoryBudgetError when the
        input and output (or one batch element's pass beside them) do not fit, routing.RouteUnavailable when a
        forced route cannot serve the input. Reads only shapes, dtypes and devices of `x` and the mask."""
        budget, source = available if available is not None else available_bytes(x.device, self.memory_budget_bytes)
        return streamed.plan(self, x, valid_token_mask, budget, source, resident_input)

    def _plan_memory(self, key, x, mask):
        """The plan of this input signature under the current cap and memory fraction: decided on the signature's
        first call and kept, so a changing free-memory reading never re-decides."""
        if len(self._memory_plans) >= MAX_MEMORY_PLANS:  # many signatures: forget the oldest decision
            self._memory_plans.pop(next(iter(self._memory_plans)))
        plan = self._memory_plans[(key, self.memory_budget_bytes, memory_fraction(x.device))] = self.memory_plan(
            x, mask)
        return plan


def _set_plain(model, name, value):
    """model.name = value for a plain attribute (never a parameter, buffer or submodule), past nn.Module.__setattr__,
    whose checks would cost the per-call path of the launch-bound routes microseconds
    (docs/decisions.md#set-plain)."""
    object.__setattr__(model, name, value)


__all__ = ["FP16_SAFE_ABS", "MAX_GRAPHS", "OPTIMIZATIONS", "RouteUnavailable", "UserOptimizedTransformer",
           "switches_used"]
