"""kernels.layer_tail.layer_tail and kernels.fused_layer.ln_qkv against fp64 references, and the split layer
they make with flash attention (ln_qkv -> flash_attention -> layer_tail) against fused_layer_reference.

On a CPU the kernels run in the Triton interpreter. Odd S (1, 7, 33), d_model that is not a power of two (48,
80), head_dim 80, ffn_dim not a multiple of the FFN block, masks with holes and a fully masked sequence, the
final norm, fp16 and bf16 operands.
"""

import pytest
import torch
import triton
from test_fused_layer import DEVICE, EPS, TOL, check, make_mask, weights

from shapewise.kernels.attention import flash_attention
from shapewise.kernels.fused_layer import (
    LN_PROJECT_BLOCK_N,
    LN_PROJECT_MIN_PROGRAMS,
    _ln_project_grid,
    fused_layer_reference,
    ln_qkv,
)
from shapewise.kernels.layer_tail import TAIL_BLOCK_M, TAIL_MIN_PROGRAMS, layer_tail, layer_tail_reference, tail_block_m
from shapewise.kernels.mask import prefix_lengths_reference

# (B, S, d_model, num_heads, ffn_dim)
SHAPES = {
    "S1": (3, 1, 32, 2, 32),
    "S7-d48-H3": (2, 7, 48, 3, 80),
    "S33-hd16": (2, 33, 64, 4, 96),
    "hd80": (1, 16, 80, 1, 80),
}


@pytest.mark.parametrize("final", [False, True], ids=["layer", "last-layer"])
@pytest.mark.parametrize("mask_kind", ["none", "holes", "one_empty"])
@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
def test_layer_tail_matches_fp64(shape, mask_kind, final):
    B, S, d, H, ffn = SHAPES[shape]
    w = weights(d, ffn, torch.float16, seed=11)
    x = torch.randn(B, S, d, device=DEVICE)
    o = torch.randn(B, S, d, device=DEVICE).to(torch.float16)
    mask = make_mask(mask_kind, B, S)
    norm = ((1 + 0.1 * torch.randn(d)).to(DEVICE), (0.1 * torch.randn(d)).to(DEVICE)) if final else None
    y = layer_tail(o, x, w, mask=mask, final=norm, out_dtype=torch.float32, block_m=16, ffn_block=16, eps=EPS)
    want = layer_tail_reference(o, x, w, mask=mask, final=norm, eps=EPS)
    check(y, want, torch.float16)
    if mask is not None and (~mask).any():
        assert y[~mask].abs().max().item() == 0.0, "invalid rows are not exactly zero"


# ln_qkv launches: (block_t, col_blocks); None: the launcher's default. d 80: 240 columns in four 64-column steps,
# the last one partial; 3 column blocks of 2 steps leave the last block one step.
LN_LAUNCHES = [(None, None), (16, 1), (16, 2), (16, 3), (16, 4)]


@pytest.mark.parametrize("launch", LN_LAUNCHES, ids=[f"{t}x{c}" for t, c in LN_LAUNCHES])
@pytest.mark.parametrize("shape", ["S7-d48-H3", "hd80"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_ln_qkv_matches_fp64(dtype, shape, launch):
    B, S, d, H, ffn = SHAPES[shape]
    w = weights(d, ffn, dtype, seed=12)
    x = torch.randn(B, S, d, device=DEVICE)
    block_t, col_blocks = launch
    qkv = ln_qkv(x, w, block_t=block_t, col_blocks=col_blocks, eps=EPS)
    assert qkv.shape == (B, S, 3 * d) and qkv.dtype == dtype
    h = torch.nn.functional.layer_norm(x.double(), (d,), w["n1_w"].double(), w["n1_b"].double(), 1e-5)
    want = h @ w["qkv_w"].double().t() + w["qkv_b"].double()
    atol, rtol = TOL[dtype]
    assert ((qkv.double() - want).abs() <= atol + rtol * want.abs()).all()


def _masks(B, S):
    """Masks of every kind the summary tells apart, one per batch element of a [B, S] batch (B >= 5): all valid,
    a prefix, left padding, holes, none valid."""
    m = torch.ones(B, S, dtype=torch.bool)
    m[1, S // 2 + 1:] = False
    m[2, : S // 3 + 1] = False
    m[3, 1::3] = False
    m[4] = False
    return m.to(DEVICE)


@pytest.mark.parametrize("launch", [(None, None), (16, 3)], ids=["default", "16x3"])
@pytest.mark.parametrize("S", [1, 7, 33])
def test_ln_qkv_writes_the_mask_summary_on_the_side(S, launch):
    """ln_qkv(..., mask=m) returns the same q/k/v and, from the same launch, kernels.mask's prefix summary."""
    B, d, ffn = 5, 48, 80
    w = weights(d, ffn, torch.float16, seed=14)
    x = torch.randn(B, S, d, device=DEVICE)
    mask = _masks(B, S)
    block_t, col_blocks = launch
    plain = ln_qkv(x, w, block_t=block_t, col_blocks=col_blocks, eps=EPS)
    qkv, summary = ln_qkv(x, w, block_t=block_t, col_blocks=col_blocks, mask=mask, eps=EPS)
    assert torch.equal(qkv, plain)
    assert summary.dtype == torch.int32 and torch.equal(summary.cpu(), prefix_lengths_reference(mask).cpu())
    with pytest.raises(ValueError, match="mask"):
        ln_qkv(x, w, mask=mask.int(), eps=EPS)


@pytest.mark.parametrize("B, S, n_cols", [(1, 128, 384), (64, 128, 384), (10000, 128, 384), (2, 7, 240),
                                           (3, 1, 96), (1, 100000, 3072)])
def test_ln_project_grid_covers_every_column_once(B, S, n_cols):
    """The default launch: every column in exactly one column block, whole 64-column steps per block, and column
    blocks only while the tokens alone give fewer than LN_PROJECT_MIN_PROGRAMS programs."""
    block_t, per, grid = _ln_project_grid(B, S, n_cols)
    assert grid[:2] == (triton.cdiv(S, block_t), B)
    assert per % LN_PROJECT_BLOCK_N == 0 and (grid[2] - 1) * per < n_cols <= grid[2] * per
    if grid[0] * B >= LN_PROJECT_MIN_PROGRAMS:
        assert grid[2] == 1
    else:
        assert grid[0] * B * grid[2] >= min(LN_PROJECT_MIN_PROGRAMS, grid[0] * B * triton.cdiv(n_cols, 64)) // 2


@pytest.mark.parametrize("n_tokens, want", [(1, 16), (128, 16), (4064, 16), (4065, 32), (8128, 32), (8129, 64),
                                            (1_280_000, 64)])
def test_tail_block_m_keeps_the_gpu_busy(n_tokens, want):
    assert tail_block_m(n_tokens) == want
    assert triton.cdiv(n_tokens, want) >= TAIL_MIN_PROGRAMS or want == TAIL_BLOCK_M[-1]


@pytest.mark.parametrize("mask_kind", ["none", "holes", "one_empty"])
@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
def test_split_layer_is_the_layer(shape, mask_kind):
    """ln_qkv, our flash attention and layer_tail compose to one whole layer (fused_layer_reference, fp64)."""
    B, S, d, H, ffn = SHAPES[shape]
    causal = S % 2 == 1
    w = weights(d, ffn, torch.float16, seed=13)
    x = torch.randn(B, S, d, device=DEVICE)
    mask = make_mask(mask_kind, B, S)
    q, k, v = ln_qkv(x, w, eps=EPS).view(B, S, 3, H, d // H).unbind(2)
    o = flash_attention(q, k, v, causal=causal, key_mask=mask, precision="fp16")
    y = layer_tail(o.view(B, S, d), x, w, mask=mask, eps=EPS)
    want = fused_layer_reference(x, {k: v.double() for k, v in w.items()}, num_heads=H, causal=causal, eps=EPS,
                                 mask=mask)
    check(y, want, torch.float16)


def test_bad_inputs_are_named():
    B, S, d, H, ffn = SHAPES["S7-d48-H3"]
    w = weights(d, ffn, torch.float16)
    x = torch.randn(B, S, d, device=DEVICE)
    o = torch.randn(B, S, d, device=DEVICE).to(torch.float16)
    with pytest.raises(ValueError, match="the layer tail serves"):
        layer_tail(torch.zeros(1, 2, 256, dtype=torch.float16), torch.zeros(1, 2, 256), w, eps=EPS)
    with pytest.raises(ValueError, match="contiguous"):
        layer_tail(o.transpose(0, 1), x.transpose(0, 1), w, eps=EPS)
    with pytest.raises(TypeError, match="share a float16/bfloat16 dtype"):
        layer_tail(o.float(), x, w, eps=EPS)
    with pytest.raises(ValueError, match="mask must be bool"):
        layer_tail(o, x, w, mask=torch.ones(B, S, dtype=torch.int32, device=DEVICE), eps=EPS)
    with pytest.raises(ValueError, match="ln_qkv: qkv_w must be"):
        ln_qkv(x, {**w, "qkv_w": w["qkv_w"].float()}, eps=EPS)



def test_the_split_layer_benchmark_runs_on_a_tiny_row(tmp_path):
    """benchmarks/split_layer.py as a user runs it (`python -m`), on its tiny CPU row: the split
    twin takes the split layer, the first model does not (its split_layer optimization is off), and both pass the
    official check against the reference."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "split.json"
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(root / "workflow"), str(root), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "benchmarks.split_layer", str(out), "--tiny"], cwd=root,
                          env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    (row,) = json.loads(out.read_text())["rows"]
    assert "split-layer" in row["route_split"] and "split-layer" not in row["route"], row
    for key in ("accuracy_model", "accuracy_split"):
        assert row[key]["official"]["failed_elements"] == 0, row[key]
    assert row["split_median_ms"] > 0 and row["model_median_ms"] > 0


@pytest.mark.parametrize("how", [["--switch", "split_layer", "--policy", "split_layer.min_tokens=null"],
                                 ["--switch", "none", "--policy", "split_layer.max_d_model=null",
                                  "--policy-on", "split_layer.max_d_model=128"]],
                         ids=["switch", "policy-on"])
def test_the_switch_benchmark_runs_the_split_layer_on_a_tiny_row(tmp_path, how):
    """benchmarks/switch_ab.py as a user runs it (`python -m`) on its tiny CPU row, with a policy entry set for the
    run and the switch off in the second model, or set while the first picks its route alone: the first model
    takes the split layer, the second does not, and the first passes the official check."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "ab.json"
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([str(root / "workflow"), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-m", "benchmarks.switch_ab", str(out), "--tiny", *how], cwd=root, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (rec,) = json.loads(out.read_text())["rows"]
    assert " split-layer" in rec["route"] and " split-layer" not in rec["route_off"], rec
    assert rec["accuracy"]["official"]["failed_elements"] == 0
