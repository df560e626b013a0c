"""Routes `triton` and `graph` (its body, captured by model/captured.py): a layer as our kernels between cuBLAS
GEMMs, or as the split layer (LayerNorm 1 + QKV, our attention, the layer tail: three kernels)."""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from ..kernels import OPERAND_DTYPES
from .config import parameter_count
from .policy import attention_without_hopper
from .precision import cublas_fp32
from .reference import LAYER_NORM_EPS
from .route_sdpa import sdpa_attention
from .weights import layer_weights, per_layer, unpacked_per_layer

# Switches without which the split layer does not run: it reads the packed QKV weight and runs our attention (and
# it needs fp16/bf16 operands: with reduced_precision off, fp32 inputs keep fp32 operands and the unfused layer).
SPLIT_NEEDS = ("split_layer", "packed_qkv", "flash_attention")


class KernelForward:
    """Each layer as our attention (or SDPA, as the route says) between cuBLAS GEMMs (the out-projection and FFN as
    kernels/linear_hopper.py where the route says so), with our fused residual add + LayerNorm; the mask summarized
    once per forward (its prefix length per sequence, or -1) for our attention."""

    uses_weights = True

    def __init__(self, model, route):
        from shapewise.kernels import attention, layernorm, mask  # deferred: triton loads when the route runs

        self.flash_attention, self.add_layernorm = attention.flash_attention, layernorm.add_layernorm
        self.prefix_lengths = mask.prefix_lengths
        if route.attention == "hopper":
            from shapewise.kernels.attention_hopper import hopper_attention  # deferred: Gluon, where the route asks

            self.hopper_attention = hopper_attention
        if route.hopper_linear:
            from shapewise.kernels.linear_hopper import linear_hopper  # deferred: Gluon, where the route asks

            self.linear_hopper = linear_hopper
        self.route = route
        disabled = model.disabled
        self.packed = "packed_qkv" not in disabled
        self.fused_ln = "fused_layernorm" not in disabled
        self.ours = "flash_attention" not in disabled
        self.w = model._weights.table(model, route.precision, per_layer if self.packed else unpacked_per_layer)
        self.act = OPERAND_DTYPES[route.precision]
        # SDPA attention under a mask that is no causal prefix: our kernel runs instead, and the route says so
        self.route_ours = replace(route, attention="triton",
                                  reason=route.reason + "; this mask is not a causal prefix: our kernel")

    @torch.no_grad()
    def __call__(self, model, x, mask):
        return self.finish(model, self.stage(model, x, mask), pdl=self.route.pdl)

    @torch.no_grad()
    def stage(self, model, x, mask):
        """The forward but its last kernel (the final residual add + LayerNorm): what `finish` takes."""
        if x.stride(-1) != 1:  # a view sliced along d_model: the kernels read rows with unit stride
            x = x.contiguous()
        route, w, act, cfg = self.route, self.w, self.act, model.config
        B, S, d = x.shape
        H, D, N = cfg.num_heads, cfg.head_dim, B * S
        sdpa_mask = mask  # the mask SDPA attention gets, where it runs
        ours = self.ours and (route.attention == "triton" or mask is not None)
        prefix = None
        if route.attention != "triton" and mask is not None and model._chunks_all_valid:
            # a chunk of a streamed forward whose mask has every token valid (read once for the call): SDPA (or the
            # Hopper attention) runs unmasked, with no summary and no host read per chunk
            sdpa_mask, ours = None, False
        elif mask is not None:
            prefix = self.prefix_lengths(mask)
            if route.attention != "triton":
                # Eager, compute-bound route (seq_len >= the policy's sdpa_from_seq_len or hopper_from_seq_len): one
                # host read of the summary per call is noise here. Under a causal prefix mask a valid query sees only
                # valid keys, so its output is that of the unmasked model and invalid rows are zeroed at every
                # layer's end: SDPA (or the Hopper attention) runs unmasked. Any other mask needs our kernel: SDPA
                # would materialize a [B, 1, S, S] boolean mask at these lengths, and the Hopper attention takes none.
                if cfg.causal and bool((prefix >= 0).all()):
                    sdpa_mask, ours = None, False
                elif self.ours:
                    object.__setattr__(model, "last_route", self.route_ours)

        pdl = route.pdl  # our kernels after layer 0's LayerNorm 1 (that one, or the mask's summary, comes first)

        def add_ln(res, branch, name, row_mask=None):  # in place after the first: x stays the caller's
            return self.add_ln(res, branch, name, out_dtype=act, row_mask=row_mask,
                               residual_out=None if res is x else res, pdl=pdl)

        def attention(h2d, i):
            if self.packed:
                q, k, v = F.linear(h2d, w[f"{i}.qkv_w"], w[f"{i}.qkv_b"]).view(B, S, 3, H, D).unbind(2)
            else:
                q, k, v = (F.linear(h2d, w[f"{i}.{n}_w"], w[f"{i}.{n}_b"]).view(B, S, H, D) for n in "qkv")
            if ours:
                return self.flash_attention(q, k, v, causal=cfg.causal, key_mask=mask, precision=route.precision,
                                            mask_prefix_lengths=prefix, pdl=pdl)
            if route.attention == "hopper" and sdpa_mask is None:  # unmasked, or a causal prefix mask (above)
                return self.hopper_attention(q, k, v, causal=cfg.causal)
            return sdpa_attention(q, k, v, cfg.causal, sdpa_mask)

        with cublas_fp32(route.precision == "tf32"):
            # normalize only: the input stays the residual
            _, h = self.add_ln(x, None, "0.n1", out_dtype=act, last=True)
            res = x
            for i in range(cfg.num_layers):
                o = attention(h.view(N, d), i)
                y = self.linear(o.reshape(N, d), f"{i}.o").view(B, S, d)
                res, h = add_ln(res, y, f"{i}.n2")
                f = self.linear(h.view(N, d), f"{i}.in", gelu=True)
                y = self.linear(f, f"{i}.out").view(B, S, d)
                if i < cfg.num_layers - 1:
                    res, h = add_ln(res, y, f"{i + 1}.n1", row_mask=mask)
        return res, y, mask, x.dtype

    @torch.no_grad()
    def finish(self, model, staged, pdl=False):
        """The forward's last kernel on what `stage` returned: the final residual add + LayerNorm into a new
        output in x's dtype, invalid rows 0. pdl: it follows the stage's kernels in the same stream."""
        res, y, mask, dtype = staged
        return self.add_ln(res, y, "final", row_mask=mask, out_dtype=dtype, last=True, pdl=pdl)[1]

    def add_ln(self, res, branch, name, *, out_dtype, row_mask=None, residual_out=None, last=False, pdl=False):
        """(new residual, LayerNorm `name` of it in out_dtype): res + branch (branch None: res alone), rows where
        row_mask is False 0; last: the residual not written; residual_out: where it goes (None: a new tensor)."""
        w = self.w
        if self.fused_ln:
            return self.add_layernorm(res, branch, w[name + "_w"], w[name + "_b"], eps=LAYER_NORM_EPS,
                                      out_dtype=out_dtype, row_mask=row_mask, write_residual=not last,
                                      residual_out=None if last else residual_out, pdl=pdl)
        r = res.float() if branch is None else res.float() + branch.float()
        if row_mask is not None:
            r = r.masked_fill(~row_mask[..., None], 0.0)
        y = F.layer_norm(r, (res.shape[-1],), w[name + "_w"], w[name + "_b"], LAYER_NORM_EPS)
        if row_mask is not None:
            y = y.masked_fill(~row_mask[..., None], 0.0)
        return r, y.to(out_dtype)

    def linear(self, a, name, gelu=False):
        """Linear layer `name` of the weight table on a [tokens, K] (exact GELU after it where `gelu`): cuBLAS, or
        where the route says so kernels/linear_hopper.py with the GELU in its epilogue."""
        w, b = self.w[name + "_w"], self.w[name + "_b"]
        if self.route.hopper_linear:
            return self.linear_hopper(a, w, b, epilogue="gelu" if gelu else "bias")
        y = F.linear(a, w, b)
        return F.gelu(y, approximate="none") if gelu else y


def tail_vector_rows(model, dtype) -> dict:
    """The Hopper layer tail's vector table of each layer, "{i}.tail_vecs" (kernels/layer_tail_hopper.py's
    `tail_vectors`; the last layer's with the final LayerNorm): a derived-weights layout, refreshed with the rest."""
    from shapewise.kernels.layer_tail_hopper import tail_vectors  # deferred: Gluon, where the route asks

    w, last = per_layer(model, dtype), len(model.layers) - 1
    return {f"{i}.tail_vecs": tail_vectors(layer_weights(w, i), (w["final_w"], w["final_b"]) if i == last else None)
            for i in range(len(model.layers))}


def qkv_vector_rows(model, dtype) -> dict:
    """The Hopper LayerNorm + QKV's vector table of each layer, "{i}.qkv_vecs" (kernels/ln_qkv_hopper.py's
    `qkv_vectors`): a derived-weights layout, refreshed with the rest."""
    from shapewise.kernels.ln_qkv_hopper import qkv_vectors  # deferred: Gluon, where the route asks

    w = per_layer(model, dtype)
    return {f"{i}.qkv_vecs": qkv_vectors(layer_weights(w, i)) for i in range(len(model.layers))}


def _per_layer_rows(model, precision, layout, name) -> list:
    """Each layer's "{i}.{name}" of the derived-weights table `layout` (built on first use, refreshed in place)."""
    rows = model._weights.table(model, precision, layout)
    return [rows[f"{i}.{name}"] for i in range(model.config.num_layers)]


class SplitLayerForward:
    """Each layer as three kernels: LayerNorm 1 with the packed QKV projection, our attention, and the rest of the
    layer (out-projection, residual, LayerNorm 2, FFN, residual, zeroed rows; the final LayerNorm last): the Triton
    tail, or the Hopper one where the route says so. With a mask, layer 0's projection also writes the mask's
    summary, which every layer's attention reads."""

    uses_weights = True

    def __init__(self, model, route):
        from shapewise.kernels import attention, fused_layer, layer_tail  # deferred: triton loads when the route runs

        self.flash_attention, self.ln_qkv, self.layer_tail = (attention.flash_attention, fused_layer.ln_qkv,
                                                              layer_tail.layer_tail)
        self.route = route
        w = model._weights.table(model, route.precision, per_layer)
        self.layers = [layer_weights(w, i) for i in range(model.config.num_layers)]
        self.final = (w["final_w"], w["final_b"])
        self.tail_vecs = self.qkv_vecs = None  # the Hopper kernels' vector tables per layer, where the route asks
        if route.hopper_tail:
            from shapewise.kernels.layer_tail_hopper import layer_tail_hopper  # deferred: Gluon, where the route asks

            self.layer_tail_hopper = layer_tail_hopper
            self.tail_vecs = _per_layer_rows(model, route.precision, tail_vector_rows, "tail_vecs")
        if route.hopper_ln_qkv:
            from shapewise.kernels.ln_qkv_hopper import ln_qkv_hopper  # deferred: Gluon, where the route asks

            self.ln_qkv_hopper = ln_qkv_hopper
            self.qkv_vecs = _per_layer_rows(model, route.precision, qkv_vector_rows, "qkv_vecs")

    def tail(self, i, o, res, mask, pdl, final=None, out_dtype=None):
        """Layer i's tail: the Hopper kernel (no PDL: the kernel after it waits for its end) or the Triton one."""
        if self.tail_vecs is not None:
            return self.layer_tail_hopper(o, res, self.layers[i], eps=LAYER_NORM_EPS, mask=mask, final=final,
                                          out_dtype=out_dtype, vecs=self.tail_vecs[i])
        return self.layer_tail(o, res, self.layers[i], eps=LAYER_NORM_EPS, mask=mask, final=final,
                               out_dtype=out_dtype, pdl=pdl)

    @torch.no_grad()
    def __call__(self, model, x, mask):
        return self.finish(model, self.stage(model, x, mask), pdl=self.route.pdl)

    @torch.no_grad()
    def stage(self, model, x, mask):
        """The forward but its last kernel (the last layer's tail with the final LayerNorm): what `finish` takes."""
        cfg = model.config
        B, S, d = x.shape
        res = x.contiguous()
        prefix = None
        pdl = self.route.pdl  # every kernel but the forward's first
        for i, wi in enumerate(self.layers):
            if i == 0 and mask is not None:  # the Triton kernel: it also writes the mask's summary
                qkv, prefix = self.ln_qkv(res, wi, eps=LAYER_NORM_EPS, mask=mask)
            elif self.qkv_vecs is not None:  # no PDL: the attention after it waits for its end
                qkv = self.ln_qkv_hopper(res, wi, eps=LAYER_NORM_EPS, vecs=self.qkv_vecs[i])
            else:
                qkv = self.ln_qkv(res, wi, eps=LAYER_NORM_EPS, pdl=pdl and i > 0)
            q, k, v = qkv.view(B, S, 3, cfg.num_heads, cfg.head_dim).unbind(2)
            o = self.flash_attention(q, k, v, causal=cfg.causal, key_mask=mask, precision=self.route.precision,
                                     mask_prefix_lengths=prefix, pdl=pdl)
            if i == cfg.num_layers - 1:
                return o.view(B, S, d), res, mask, x.dtype
            res = self.tail(i, o.view(B, S, d), res, mask, pdl)

    @torch.no_grad()
    def finish(self, model, staged, pdl=False):
        """The forward's last kernel on what `stage` returned: the last layer's tail and the final LayerNorm into a
        new output in x's dtype, invalid rows 0. pdl: it follows the stage's kernels in the same stream."""
        o, res, mask, dtype = staged
        return self.tail(len(self.layers) - 1, o, res, mask, pdl, final=self.final, out_dtype=dtype)


def runner(model, route):
    return (SplitLayerForward if route.split_layer else KernelForward)(model, route)


def settle(route, x, disabled):
    """The split layer only with its switches on and fp16/bf16 operands; else the unfused layer, and why."""
    if route.split_layer and (route.precision not in ("fp16", "bf16") or disabled & set(SPLIT_NEEDS)):
        off = sorted(disabled & set(SPLIT_NEEDS)) or [f"{route.precision} operands"]
        route = replace(route, split_layer=False, reason=route.reason + f"; no split layer: {', '.join(off)}")
    if route.hopper_linear and ("hopper_linear" in disabled or route.precision not in ("fp16", "bf16")):
        why = "hopper_linear disabled" if "hopper_linear" in disabled else f"{route.precision} operands"
        route = replace(route, hopper_linear=False, reason=route.reason + f"; no Hopper linear layers: {why}")
    for field, what in (("hopper_tail", "Hopper layer tail"), ("hopper_ln_qkv", "Hopper LayerNorm + QKV")):
        if getattr(route, field) and (not route.split_layer or field in disabled):
            why = f"{field} disabled" if field in disabled else "no split layer"
            route = replace(route, **{field: False}, reason=route.reason + f"; no {what}: {why}")
    if route.eager_tail and disabled & {"eager_tail", "cuda_graph"}:
        off = ", ".join(sorted(disabled & {"eager_tail", "cuda_graph"}))
        route = replace(route, eager_tail=False, reason=route.reason + f"; no eager tail: {off} disabled")
    if route.attention == "hopper" and ("hopper_attention" in disabled or route.precision != "fp16"):
        # the Gluon kernel takes fp16 operands: otherwise (and switched off) the attention the policy had before it
        why = "hopper_attention disabled" if "hopper_attention" in disabled else f"{route.precision} operands"
        route = replace(route, attention=attention_without_hopper(x.shape[1]),
                        reason=route.reason + f"; no Hopper attention: {why}")
    return route


def switches(route) -> set:
    tail = {"eager_tail"} if route.eager_tail else set()
    if route.split_layer:  # each switch of SPLIT_NEEDS turns it off
        return set(SPLIT_NEEDS) | tail | {n for n in ("hopper_tail", "hopper_ln_qkv") if getattr(route, n)}
    return tail | ({"fused_layernorm", "packed_qkv"} | ({"flash_attention"} if route.attention == "triton" else set())
            | ({"hopper_attention"} if route.attention == "hopper" else set())
            | ({"hopper_linear"} if route.hopper_linear else set()))


def sdpa_gets_mask(route, disabled) -> bool:
    """With our attention switched off, SDPA gets the mask (under a causal prefix mask it runs unmasked, but the
    plan reads no mask contents and takes the worst case)."""
    return "flash_attention" in disabled


def working_set(config, dtype, route) -> int:
    """Per token 4d (fp32 residual) + a * (6d + 2f) (normalized input, qkv, attention out, its reshape, the
    projection, and the FFN's linear and GELU outputs: the peak of the eager sequence) + 4H (softmax statistics), a
    the operands' bytes; split layers (4d + 4ad: the next residual, qkv and the attention out) allocate less, and
    take this bound. Plus the weight copies in operand precision."""
    a, d = OPERAND_DTYPES[route.precision].itemsize, config.d_model
    acts = config.tokens * (4 * d + a * (6 * d + 2 * config.ffn_dim) + 4 * config.num_heads)
    return acts + parameter_count(d, config.ffn_dim, config.num_layers) * a
