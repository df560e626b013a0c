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

from benchmarks.common import contract, official, parser, write_json
from shapewise.jobs.inputs import FIRST_TRIAL_SEED, make_case
from shapewise.jobs.models import build_models, model_config
from shapewise.model import TOLERANCES, compare_outputs
from shapewise.model.reference import LAYER_NORM_EPS

CLASSES = ("weights", "ln_out", "qkv", "probs", "attn_out", "gemm_out", "gelu_out")


def emulated_forward(state, config, x, mask, rounded):
    """The unfused layer's forward in fp32 torch, rounding to fp16 at the classes in `rounded`."""
    def r(t, cls):
        return t.half().float() if cls in rounded else t

    B, S, d = x.shape
    H, N = config.num_heads, B * S
    D = d // H
    p = {k: v.float() for k, v in state.items()}
    rows = torch.ones(N, dtype=torch.bool) if mask is None else mask.reshape(N)

    def linear(a, name, out_cls=None):
        y = a @ r(p[f"{name}.weight"], "weights").t() + p[f"{name}.bias"]
        return y if out_cls is None else r(y, out_cls)

    def layer_norm(res, name):
        y = torch.nn.functional.layer_norm(res, (d,), p[f"{name}.weight"], p[f"{name}.bias"], LAYER_NORM_EPS)
        return r(y.masked_fill(~rows[:, None], 0.0), "ln_out")

    hidden = ~rows.view(B, 1, 1, S)
    if config.causal:
        hidden = hidden | torch.ones(S, S, dtype=torch.bool).triu(1)
    res = x.reshape(N, d).float()
    for i in range(config.num_layers):
        a = f"layers.{i}.attention"
        h = layer_norm(res, f"layers.{i}.norm1")
        q, k, v = (linear(h, f"{a}.{n}_proj", "qkv").view(B, S, H, D).transpose(1, 2) for n in "qkv")
        scores = (q @ k.transpose(-1, -2)) * D**-0.5
        probs = torch.softmax(scores.masked_fill(hidden, float("-inf")), -1).nan_to_num(0.0)
        o = r((r(probs, "probs") @ v).transpose(1, 2).reshape(N, d), "attn_out")
        res = res + linear(o, f"{a}.out_proj", "gemm_out")
        h = layer_norm(res, f"layers.{i}.norm2")
        f = r(torch.nn.functional.gelu(linear(h, f"layers.{i}.ffn_in", "gemm_out")), "gelu_out")
        res = (res + linear(f, f"layers.{i}.ffn_out", "gemm_out")).masked_fill(~rows[:, None], 0.0)
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
    shape_row = official(int(args.row[9:])) if args.row.startswith("official-") else contract(args.row)
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
