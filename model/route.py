"""What a route is, apart from the policy that picks one (model/routing.py): the `Route` a forward runs, the error
a forced route that cannot serve raises, and the hooks of a route's module (model/route_<name>.py, `RouteModule`).

A leaf: it imports nothing of the package, so the route modules import it and `routing.route_module` imports them,
without a cycle.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Protocol, runtime_checkable


class RouteUnavailable(RuntimeError):
    """A forced route cannot serve this input."""


@dataclass(frozen=True)
class Route:
    name: str
    precision: str  # operand precision of GEMMs and attention matmuls ("fp32" = exact fp32)
    reason: str
    forced: bool = False
    attention: str = "triton"  # attention inside the triton/graph routes: our kernel, PyTorch SDPA, or "hopper"
    # (kernels/attention_hopper.py, from the policy's attention.hopper_from_seq_len on sm_90)
    launch: tuple = ()  # fused: (block_m, num_warps, num_stages) (policy)
    kv_precompute: bool = False  # fused route: keys/values computed once per layer by a second kernel (policy)
    key_block: int = 0  # fused route with kv_precompute: keys per online-softmax step (policy; 0: the whole sequence)
    ffn_block: int = 0  # fused route: FFN columns per step (policy; 0: the kernel's default)
    split_layer: bool = False  # triton/graph routes: each layer as ln_qkv, our attention and layer_tail (policy)
    pdl: bool = False  # kernels after the forward's first launch with programmatic dependent launch (`with_pdl`)
    eager: bool = False  # a captured route launched eagerly here: policy `hopper.eager_min_batch`, or beyond
    # `graph.max_tokens_x_d_model` (`_hopper_route`)
    pair: bool = False  # hopper route: two programs a causal sequence (policy `hopper.pair_max_batch`)
    producer: bool = False  # hopper route: a loader warp fills the weight ring (policy `hopper.producer_max_head_dim`)
    duo: bool = False  # hopper route: a causal sequence's halves as two warpgroups of one program, with a loader warp
    # (policy `hopper.duo_max_head_dim`; in place of `pair` and `producer`)
    prepared_launch: bool = False  # hopper route: eager through its signature's PreparedLaunch (eager_min_batch)
    direct_launch: bool = False  # prepared launch: Triton's C launcher called with an argument list built once
    # (policy `hopper.direct_launch`; off: through the compiled kernel's `run`)
    eager_tail: bool = False  # graph route: the forward's last kernel launched after the replay into a new output,
    # not captured and copied out of the graph's buffer (policy `graph.eager_tail_min_tokens_x_d_model`)
    hopper_linear: bool = False  # triton/graph routes' unfused layer: the out-projection, FFN-in (exact GELU in its
    # epilogue) and FFN-out as kernels/linear_hopper.py (policy `hopper_linear.min_d_model`, sm_90)
    hopper_tail: bool = False  # split layer: each layer's tail as kernels/layer_tail_hopper.py (policy
    # `split_layer.hopper_tail_min_tokens`, sm_90)
    hopper_ln_qkv: bool = False  # split layer: LayerNorm 1 + QKV as kernels/ln_qkv_hopper.py but where it writes the
    # mask's summary (policy `split_layer.hopper_ln_qkv_min_tokens`, sm_90)

    def __str__(self) -> str:
        how = "forced" if self.forced else "auto"
        attn = "" if self.attention == "triton" else f"+{self.attention}-attention"
        launch = f" launch={self.launch}" if self.launch else ""
        kv = " kv=precomputed" if self.kv_precompute else ""
        blocks = "".join(f" {n}={v}" for n, v in (("key_block", self.key_block), ("ffn_block", self.ffn_block)) if v)
        split = " split-layer" if self.split_layer else ""
        split += " hopper-linear" if self.hopper_linear else ""
        split += " hopper-tail" if self.hopper_tail else ""
        split += " hopper-ln-qkv" if self.hopper_ln_qkv else ""
        pair = " pair" if self.pair else ""
        pair += " producer" if self.producer else ""
        pair += " duo" if self.duo else ""
        pdl = " pdl" if self.pdl else ""
        eager = " eager" if self.eager else ""
        eager += " prepared-launch" if self.prepared_launch else ""
        eager += " direct-launch" if self.direct_launch else ""
        eager += " eager-tail" if self.eager_tail else ""
        return f"{self.name}/{self.precision}{attn}{launch}{kv}{blocks}{split}{pair}{pdl}{eager} ({how}: {self.reason})"

    def as_dict(self) -> dict:  # JSON-ready: the launch tuple as a list
        return {**asdict(self), "launch": list(self.launch)}


@runtime_checkable
class Runner(Protocol):
    """What a route module's `runner(model, route)` returns: the forward of one input signature."""

    route: Route  # what the model's `last_route` reports
    uses_weights: bool  # it reads derived weights (model/weights.py): a forward checks their parameters' versions

    def __call__(self, model, x, mask):
        """The forward of `x` (and `mask`, bool [B, S] or None) on `model`: [B, S, d_model] in x's dtype."""


@runtime_checkable
class StagedRunner(Runner, Protocol):
    """A runner whose forward splits before its last kernel, as a route with `eager_tail` needs (model/captured.py
    captures `stage` and launches `finish` after each replay): route `graph`'s runners, model/route_triton.py."""

    def stage(self, model, x, mask):
        """The forward but its last kernel: what `finish` takes (tensors a CUDA graph may own)."""

    def finish(self, model, staged, pdl=False):
        """The last kernel on `staged`, into a new output: `__call__` is `finish(model, stage(model, x, mask))`."""


@runtime_checkable
class RouteModule(Protocol):
    """The module that runs a route, model/<RouteSpec.module>.py, as `routing.route_module` returns it: the hooks
    every route module defines. Those of `OptionalHooks` it defines where it needs them."""

    def runner(self, model, route: Route) -> Runner:
        """The runner of one input signature of `model` on `route`."""

    def working_set(self, config, dtype, route: Route) -> int:
        """The bytes its forward allocates besides input and output (model/memory.py adds the rest)."""

    def switches(self, route: Route) -> set:
        """The OPTIMIZATIONS (model/optimized.py) that change what it runs: empty without our kernels."""


class OptionalHooks(Protocol):
    """The hooks a route module defines where it needs them; its callers look each up with `getattr`, and an absent
    one means what its docstring says."""

    def why_unsupported(self, shape) -> str | None:
        """Why its kernels cannot serve `shape` (a TransformerConfig: batch_size and seq_len the input's), or None. Absent: they serve any shape."""

    def settle(self, route: Route, x, disabled: set) -> Route:
        """The route under the model's switches `disabled` and operand precision, for input `x`: refused
        (RouteUnavailable), adjusted or kept. Absent: kept."""

    def sdpa_gets_mask(self, route: Route, disabled: set) -> bool:
        """Whether PyTorch SDPA may get a valid-token mask on this route (model/memory.py counts the dense mask
        it builds). Absent: never."""
