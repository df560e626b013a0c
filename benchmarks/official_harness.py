"""The official harness's medians of whichever `shapewise` package is importable: this checkout's, or another
commit's installed beside it, so that two commits are timed by the same code in one run.

Usage (CUDA machine): python benchmarks/official_harness.py OUT.json [--rows 1,2,3] [--label TEXT]

Run as a file, not with -m: then `shapewise` comes from PYTHONPATH (e.g. another commit's package installed with
`pip install --target DIR`), and this script imports nothing of the checkout it sits in but the official shape
table next to it. Per official row, as the published script does: the reference seeded and the optimized model
loaded with its weights (strict), x = randn(B, S, d) * input_scale seeded, the all-True bool mask passed as
`model(x, mask)`, TF32 allowed; 20 warm-up calls of each model, then 3 rounds alternating them, 100 calls of each a
round, a CUDA event pair around every call and no synchronization between calls; each model's median over its 300
calls, and the speedup reference / optimized.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import yaml

MANIFEST = Path(__file__).resolve().parents[1] / "shapes" / "official.yaml"
PROTOCOL = {"warmup": 20, "rounds": 3, "calls": 100}  # the official harness's (benchmarks.host_path's too)
SEED = 0


def call_ms(fn, calls):
    """[ms] of `calls` back-to-back calls of `fn`, an event pair around each, one synchronize at the end."""
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(calls)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]


def time_row(row):
    """{reference_ms, optimized_ms, speedup, route} of one official row."""
    from shapewise.model.config import TransformerConfig
    from shapewise.model.optimized import UserOptimizedTransformer
    from shapewise.model.reference import BaselineTransformer

    config = TransformerConfig(**{k: row[k] for k in ("batch_size", "seq_len", "d_model", "num_heads", "ffn_dim",
                                                      "num_layers")}, causal=row.get("causal", True))
    torch.manual_seed(SEED)
    reference = BaselineTransformer(config).cuda().eval()
    model = UserOptimizedTransformer(config).cuda().eval()
    model.load_state_dict(reference.state_dict(), strict=True)
    generator = torch.Generator(device="cuda").manual_seed(SEED)
    x = torch.randn(config.batch_size, config.seq_len, config.d_model, device="cuda",
                    generator=generator) * row.get("input_scale", 1.0)
    mask = torch.ones(config.batch_size, config.seq_len, dtype=torch.bool, device="cuda")
    models = {"reference": reference, "optimized": model}
    times = {name: [] for name in models}
    with torch.inference_mode():
        for m in models.values():
            for _ in range(PROTOCOL["warmup"]):
                m(x, mask)
        torch.cuda.synchronize()
        for _ in range(PROTOCOL["rounds"]):
            for name, m in models.items():
                times[name] += call_ms(lambda m=m: m(x, mask), PROTOCOL["calls"])
    out = {f"{name}_ms": statistics.median(t) for name, t in times.items()}
    out["speedup"] = out["reference_ms"] / out["optimized_ms"]
    out["route"] = str(getattr(model, "last_route", None))
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="JSON file to write")
    p.add_argument("--rows", default="1,2,3,4,5,7,9,10,11,12", help="official rows, 1-based")
    p.add_argument("--label", default="", help="what code is measured (a commit), recorded in the file")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("official_harness: needs a CUDA device")
    import shapewise

    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    table = yaml.safe_load(MANIFEST.read_text())
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "label": args.label,
              "package": str(Path(shapewise.__file__).parent), "protocol": PROTOCOL, "rows": {}}
    for n in (int(r) for r in args.rows.split(",")):
        if not 1 <= n <= len(table):
            raise SystemExit(f"official_harness: --rows {n}: the table {MANIFEST} has rows 1-{len(table)}")
        rec = result["rows"][n] = time_row(table[n - 1])
        print(f"official row {n}: optimized {rec['optimized_ms'] * 1e3:.1f} us, reference "
              f"{rec['reference_ms'] * 1e3:.1f} us, speedup {rec['speedup']:.1f}; {rec['route']}", flush=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
