"""Which fused-layer row blocks beyond fused_layer.MAX_BLOCK_M run correctly on this GPU, each in a process of its own.

Usage (CUDA machine): python -m benchmarks.fused_block_m [OUT.json]

The fused layer refuses block_m above MAX_BLOCK_M because 64 and 128 ended in an illegal memory access on the
H200 (docs/decisions.md#fused-block-m), and a crash poisons the CUDA context for everything after it in the same
process. Here every configuration runs in a child process (a crash costs only that child) on official rows 1 and
6, plain and with a non-prefix mask, in three settings: as Triton compiles it by default; with keys and values
precomputed by _ln_kv_fwd (kv_precompute: the score dot's B operand is a loaded tile, and no program recomputes
K/V); and with DISABLE_MMA_V3=1 (no Hopper wgmma at all). Each setting has its own Triton cache. Each record: exit
status, the error's last line, max abs error against the fp64 reference, and the GPU time of one launch (graph
replay of 10 launches / 10). Nothing here changes the policy.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

from benchmarks.common import parser, write_json

CONFIGS = [(32, 4, 2), (64, 4, 1), (64, 4, 2), (64, 8, 1), (64, 8, 2), (128, 4, 2), (128, 8, 2)]
ROWS = (1, 6)  # official rows
# name: (environment, kv_precompute)
SETTINGS = {"default": ({}, False), "kv-precompute": ({}, True), "no-wgmma": ({"DISABLE_MMA_V3": "1"}, False)}


def child(block_m, num_warps, num_stages, kv_precompute):
    import torch

    import shapewise.kernels.fused_layer as fl
    from benchmarks.common import shape_of
    from benchmarks.launch_sweep import fused_case, measure_fused

    fl.MAX_BLOCK_M = 128  # this process exists to probe the sizes the library refuses
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: TRITON_INTERPRET=1, to check this script
    out = [{"row": row, **measure_fused(fused_case(row, *shape_of(row), dev=dev), block_m=block_m,
                                        num_warps=num_warps, num_stages=num_stages,
                                        kv_precompute=bool(kv_precompute))}
           for row in ROWS]
    print("RESULT " + json.dumps(out), flush=True)


def main():
    args = parser(__doc__, "fused-block-m.json").parse_args()
    results = []
    for setting, (env_extra, kv_precompute) in SETTINGS.items():
        cache = tempfile.mkdtemp(prefix=f"triton-{setting}-")
        for cfg in CONFIGS:
            env = dict(os.environ, TRITON_CACHE_DIR=cache, **env_extra)
            try:
                command = [sys.executable, "-m", "benchmarks.fused_block_m", "--child", *map(str, cfg),
                           str(int(kv_precompute))]
                done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
                rc, text = done.returncode, done.stdout + done.stderr
            except subprocess.TimeoutExpired as e:
                rc, text = "timeout", (e.stdout or "") + (e.stderr or "")
                text = text.decode() if isinstance(text, bytes) else text
            rec = {"setting": setting, "block_m": cfg[0], "num_warps": cfg[1], "num_stages": cfg[2], "rc": rc}
            found = [line for line in text.splitlines() if line.startswith("RESULT ")]
            if found:
                rec["rows"] = json.loads(found[-1][len("RESULT "):])
            else:
                errors = [line for line in text.splitlines() if "Error" in line or "error" in line]
                rec["error"] = (errors[-1] if errors else text.strip().splitlines()[-1:] or [""])[0][:300]
            results.append(rec)
            print(json.dumps(rec), flush=True)
            write_json(args.out, results)


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--child":
        child(*map(int, sys.argv[2:]))
    else:
        main()
