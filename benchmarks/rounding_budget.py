"""Which fp16 roundings of the unfused layer make a row fail: its forward emulated in torch with each class of
rounding applied or not, against the fp32 reference (CPU).

Usage (CPU): python -m benchmarks.rounding_budget [OUT.json] [--row contract-scale-small] [--batch 16] [--trials 3]

The unfused layer (routes `triton` and `graph`) computes in fp32 and rounds to fp16 at these places, the classes
here: `weights` (every GEMM's weight), `ln_out` (the LayerNorms' outputs, the QKV and FFN-in GEMMs' A operand),
`qkv` (the QKV GEMM's output: attention's q, k and v), `probs` (the softmax's probabilities before P V),
`attn_out` (attention's output, the out-projection's A operand), `gemm_out` (the out-projection's, FFN-in's and
FFN-out's outputs, before the residual add or the GELU) and `gelu_out` (FFN-out's A operand). Products accumulate in
fp32, softmax and LayerNorm statistics in fp32, as the kernels do. For each trial: every class rounded (the route as
it is), each class alone left exact, and each class alone rounded; failed elements at the official and the strict
tolerance; and each class left exact beside the weights. The row's weights and inputs are the pipeline's (its
batch cut to --batch sequences).
"""
from __future__ import annotations

import torch

from benchmarks.common import named_row, parser, write_json
from shapewise.jobs.inputs import FIRST_TRIAL_SEED, make_case
from shapewise.jobs.models import build_models, model_config
from shapewise.model import TOLERANCES, compare_outputs
from shapewise.model.reference import LAYER_NORM_EPS

CLASSES = ("weights", "ln_out", "qkv", "probs", "attn_out", "gemm_out", "gelu_out")


def emulated_forward(state, config, x, mask, rounded, fold=False, acc=torch.float32):
    """The unfused layer's forward in `acc` torch, rounding to fp16 at the classes in `rounded`. `fold`: the
    LayerNorms before the QKV and FFN-in GEMMs folded into them (LN(x) W^T + b = rstd (x W'^T) - rstd mean
    colsum(W') + b', W' = W diag(gamma) as the GEMM's weight, b' = b + W beta: the A operand is the residual itself,
    rounded as `ln_out`, the row statistics exact)."""
    def r(t, cls):
        return t.half().to(acc) if cls in rounded else t

    B, S, d = x.shape
    H, N = config.num_heads, B * S
    D = d // H
    p = {k: v.to(acc) for k, v in state.items()}
    rows = torch.ones(N, dtype=torch.bool) if mask is None else mask.reshape(N)

    def linear(a, w, b, out_cls):
        return r(a @ r(w, "weights").t() + b, out_cls)

    def normed_linear(res, norm, names, out_cls):
        """[LN(res) W^T + b for each linear layer of `names`], as the GEMM after the LayerNorm `norm` computes it."""
        g, beta = p[f"{norm}.weight"], p[f"{norm}.bias"]
        if not fold:
            h = torch.nn.functional.layer_norm(res, (d,), g, beta, LAYER_NORM_EPS)
            h = r(h.masked_fill(~rows[:, None], 0.0), "ln_out")
            return [linear(h, p[f"{n}.weight"], p[f"{n}.bias"], out_cls) for n in names]
        mean = res.mean(-1, keepdim=True)
        rstd = (res.var(-1, unbiased=False, keepdim=True) + LAYER_NORM_EPS).rsqrt()
        a = r(res, "ln_out")
        out = []
        for n in names:
            w, b = p[f"{n}.weight"], p[f"{n}.bias"]
            w_folded = r(w * g, "weights")
            out.append(r(rstd * (a @ w_folded.t()) - rstd * mean * w_folded.sum(1) + (b + w @ beta), out_cls))
        return out

    hidden = ~rows.view(B, 1, 1, S)
    if config.causal:
        hidden = hidden | torch.ones(S, S, dtype=torch.bool).triu(1)
    res = x.reshape(N, d).to(acc)
    for i in range(config.num_layers):
        a = f"layers.{i}.attention"
        q, k, v = (t.view(B, S, H, D).transpose(1, 2) for t in normed_linear(
            res, f"layers.{i}.norm1", [f"{a}.{n}_proj" for n in "qkv"], "qkv"))
        scores = (q @ k.transpose(-1, -2)) * D**-0.5
        probs = torch.softmax(scores.masked_fill(hidden, float("-inf")), -1).nan_to_num(0.0)
        o = r((r(probs, "probs") @ v).transpose(1, 2).reshape(N, d), "attn_out")
        res = res + linear(o, p[f"{a}.out_proj.weight"], p[f"{a}.out_proj.bias"], "gemm_out")
        (f,) = normed_linear(res, f"layers.{i}.norm2", [f"layers.{i}.ffn_in"], "gemm_out")
        f = r(torch.nn.functional.gelu(f), "gelu_out")
        ffn_out = linear(f, p[f"layers.{i}.ffn_out.weight"], p[f"layers.{i}.ffn_out.bias"], "gemm_out")
        res = (res + ffn_out).masked_fill(~rows[:, None], 0.0)
    out = torch.nn.functional.layer_norm(res, (d,), p["final_norm.weight"], p["final_norm.bias"], LAYER_NORM_EPS)
    return out.masked_fill(~rows[:, None], 0.0).view(B, S, d)


def failures(want, got):
    return {tol: compare_outputs(want, got, **bounds).failed_elements for tol, bounds in TOLERANCES.items()}


def main():
    p = parser(__doc__, "rounding-budget.json")
    p.add_argument("--row", default="contract-scale-small", help="a row of shapes/contract.yaml, or official-NN")
    p.add_argument("--batch", type=int, default=16, help="sequences of the row's batch kept")
    p.add_argument("--trials", type=int, default=3, help="trials (the pipeline's seeds)")
    args = p.parse_args()
    shape_row = named_row(args.row)
    row = {**shape_row, "batch_size": min(args.batch, shape_row["batch_size"]), "route": "triton"}
    config = model_config(row)
    cpu = torch.device("cpu")
    reference, _ = build_models(row, config, cpu)
    state = reference.state_dict()
    torch.set_float32_matmul_precision("highest")
    arms = {"all": set(CLASSES), "none": set()}
    arms.update({f"all but {c}": set(CLASSES) - {c} for c in CLASSES})
    arms.update({f"only {c}": {c} for c in CLASSES})
    arms.update({f"all but weights, {c}": set(CLASSES) - {"weights", c} for c in CLASSES if c != "weights"})
    result = {"row": args.row, "batch_size": row["batch_size"], "classes": CLASSES, "torch": torch.__version__,
              "trials": []}
    for trial in range(args.trials):
        x, mask, _ = make_case(row, config, cpu, FIRST_TRIAL_SEED + trial)
        with torch.inference_mode():
            want = reference(x, mask)
            rec = {"seed": FIRST_TRIAL_SEED + trial, "elements": want.numel(),
                   "arms": {name: failures(want, emulated_forward(state, config, x, mask, rounded))
                            for name, rounded in arms.items()}}
        result["trials"].append(rec)
        print({k: v["official"] for k, v in rec["arms"].items()}, flush=True)
        write_json(args.out, result)


if __name__ == "__main__":
    main()
