"""Failed elements of a row with the unfused layer's roundings against those of the Hopper linear layers' fp32
epilogues (route `triton`, with and without `hopper_linear`), on the CPU under the Triton interpreter.

Usage (CPU): TRITON_INTERPRET=1 python -m benchmarks.epilogue_precision [OUT.json] [--row contract-scale-small]
                 [--batch 4] [--trials 2]

The Hopper kernel cannot run on the CPU, so its computation is emulated in torch as it rounds: operands as given
(fp16), products accumulated in fp32, bias, GELU and residual added in fp32, then one rounding to the output's
dtype. The unfused layer rounds FFN-in's output to fp16 before its GELU; the route's Hopper layers apply it first.
Everything else (LayerNorms, attention: our Triton kernels under the interpreter) is the route's own. The row's
weights and trial inputs are the pipeline's (its batch cut to --batch sequences: the interpreter is slow); each
trial's failed elements at the official and the strict tolerance against the fp32 reference.

Two forwards emulated wholly in torch beside them, with one attention (fp16 q, k, v and probabilities, fp32 scores
and softmax) so that they differ by one thing, both with the residual added in the out-projection's and FFN-out's
epilogues (the kernel's `residual` epilogue, the GEMM's output never rounded): `emulated_hopper_linear`, every
GEMM's A operand a LayerNorm's fp16 output, and `emulated_ln_folded`, the LayerNorms folded into the QKV and FFN-in
GEMMs (LN(x) W^T + b = rstd (x W'^T) - rstd mean colsum(W') + b', W' = W diag(gamma) in fp16, b' = b + W beta: the
A operand is the residual itself rounded to fp16, the row statistics exact), the design that would drop the
LayerNorm passes.
"""
from __future__ import annotations

import dataclasses
import os

import torch

from benchmarks import rounding_budget
from benchmarks.common import named_row, parser, write_json
from shapewise.jobs.inputs import FIRST_TRIAL_SEED, make_case
from shapewise.jobs.models import build_models, model_config
from shapewise.kernels import linear_hopper as lh
from shapewise.model import TOLERANCES, compare_outputs, route_triton

# the roundings of both emulated forwards: every class of rounding_budget's but the GEMMs' outputs (the epilogue
# adds bias, GELU and residual in fp32 before its one rounding)
ROUNDED = frozenset(rounding_budget.CLASSES) - {"gemm_out"}


def linear_as_the_kernel_rounds(a, w, bias, *, epilogue="bias", residual=None, row_mask=None, out=None):
    """linear_hopper's contract computed as its kernel rounds: fp32 accumulation and epilogue, one rounding."""
    y = a.float() @ w.float().t() + bias.float()
    if epilogue == "gelu":
        y = torch.nn.functional.gelu(y, approximate="none")
    if epilogue == "residual":
        y = residual + y
    if row_mask is not None:
        y = y.masked_fill(~row_mask.reshape(-1, 1), 0.0)
    y = y.to(torch.float32 if epilogue == "residual" else a.dtype)
    return y if out is None else out.copy_(y)


def emulated_forward(state, config, x, mask, fold):
    """The forward with the Hopper linear layers' roundings, in torch (module docstring); `fold`: the LayerNorms
    before the QKV and FFN-in GEMMs folded into them."""
    return rounding_budget.emulated_forward(state, config, x, mask, ROUNDED, fold=fold)


def main():
    p = parser(__doc__, "epilogue-precision.json")
    p.add_argument("--row", default="contract-scale-small", help="a row of shapes/contract.yaml, or official-NN")
    p.add_argument("--batch", type=int, default=4, help="sequences of the row's batch kept")
    p.add_argument("--trials", type=int, default=2, help="trials (the pipeline's seeds)")
    args = p.parse_args()
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("run with TRITON_INTERPRET=1: the route's Triton kernels run under the interpreter")
    shape_row = named_row(args.row)
    row = {**shape_row, "batch_size": args.batch, "route": "triton"}
    config = model_config(row)
    cpu = torch.device("cpu")
    reference, model = build_models(row, config, cpu)
    lh.linear_hopper = linear_as_the_kernel_rounds  # KernelForward takes it from the module when built
    torch.set_float32_matmul_precision("highest")
    result = {"row": args.row, "batch_size": args.batch, "torch": torch.__version__, "trials": []}
    for trial in range(args.trials):
        x, mask, _ = make_case(row, config, cpu, FIRST_TRIAL_SEED + trial)
        with torch.inference_mode():
            want = reference(x, mask)
            outputs = {"unfused": model(x, mask)}
            hopper = dataclasses.replace(model.last_route, hopper_linear=True)
            outputs["hopper_linear"] = route_triton.KernelForward(model, hopper)(model, x, mask)
            state = model.state_dict()
            outputs["emulated_hopper_linear"] = emulated_forward(state, config, x, mask, fold=False)
            outputs["emulated_ln_folded"] = emulated_forward(state, config, x, mask, fold=True)
        rec = {"seed": FIRST_TRIAL_SEED + trial}
        for name, got in outputs.items():
            for tol, bounds in TOLERANCES.items():
                c = compare_outputs(want, got, **bounds)
                rec[f"{name}_{tol}_failed"] = c.failed_elements
            rec[f"{name}_mean_abs_error"] = c.mean_abs_error
        rec["elements"] = c.total_elements
        result["trials"].append(rec)
        print(rec, flush=True)
        write_json(args.out, result)


if __name__ == "__main__":
    main()
