"""A FLOP and minimum-bytes model of one forward pass, and its roofline floor.

FLOPs (multiply-add = 2):
  GEMMs      2 * tokens * (4 d^2 + 2 d ffn) * layers   (Q, K, V, out; FFN in, out)
  attention  4 * B * S^2 * d * layers                  (QK^T and PV), halved when causal
Bytes (the least any implementation must move through device memory):
  read x once, write the output once (tokens * d * element size each), and
  read every weight once (the parameter count times the element size).
Everything else (LayerNorm, softmax, GELU, biases) is left out of the FLOPs:
the floor is a lower bound, so leaving work out only lowers it.

floor = max(FLOPs / peak FLOP/s, bytes / bandwidth); fraction of the floor
reached = floor / measured time (1.0 would be a perfect kernel).
"""

from __future__ import annotations

from shapewise.model.config import parameter_count

ELEMENT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}

# Which microbench GEMM entries bound a row's matmuls: the fastest of them. An
# fp32 row may run on TF32 tensor cores, and the routing policy runs fp32 rows
# with fp16 operands (fp32 accumulation), so its floor takes the fp16/bf16
# rate when that is higher: a floor is a lower bound on time. bfloat16 rows run fp16
# operands too (routing policy, low_precision_operands), or bf16 ones where weights
# exceed fp16's range.
PEAK_ENTRIES = {"float32": ("tf32", "fp16", "bf16"), "float16": ("fp16",), "bfloat16": ("fp16", "bf16")}


def flops(batch_size, seq_len, d_model, ffn_dim, num_layers, causal=True, **_):
    tokens = batch_size * seq_len
    gemm = 2 * tokens * (4 * d_model * d_model + 2 * d_model * ffn_dim) * num_layers
    attention = 4 * batch_size * seq_len * seq_len * d_model * num_layers
    if causal:
        attention //= 2
    return {"gemm": gemm, "attention": attention, "total": gemm + attention}


def min_bytes(batch_size, seq_len, d_model, ffn_dim, num_layers, dtype="float32", **_):
    elem = ELEMENT_BYTES[dtype]
    activations = 2 * batch_size * seq_len * d_model * elem
    weights = parameter_count(d_model, ffn_dim, num_layers) * elem
    return {"activations": activations, "weights": weights, "total": activations + weights}


def floor_seconds(row, peak_flops_per_s, bandwidth_bytes_per_s):
    """The roofline floor of one forward of `row` (a manifest row) in seconds."""
    f = flops(**row)["total"]
    b = min_bytes(**row)["total"]
    compute = f / peak_flops_per_s if peak_flops_per_s else None
    memory = b / bandwidth_bytes_per_s if bandwidth_bytes_per_s else None
    parts = [t for t in (compute, memory) if t is not None]
    if not parts:
        return None
    return {
        "floor_s": max(parts),
        "compute_s": compute,
        "memory_s": memory,
        "bound": "compute" if compute is not None and compute == max(parts) else "memory",
        "flops": f,
        "bytes": b,
    }
