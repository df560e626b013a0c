"""kernels/layer_tail_hopper.py and kernels/ln_qkv_hopper.py: limits, vector tables and sm_90a builds (CPU,
offline), and on a Hopper GPU each kernel against its fp64 reference: ragged token counts (a block and a consumer's
turn cut short), the widths served, fp16 and bf16 operands, masks with holes and an empty sequence, the final
LayerNorm, one program and several (the slots' phases wrapping many times); the model's split layer with them."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from test_fused_layer import TOL, make_mask, weights

from shapewise.kernels import layer_tail_hopper as th
from shapewise.kernels.layer_tail import layer_tail_reference

ROOT = Path(__file__).resolve().parent.parent
ON_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
needs_hopper = pytest.mark.skipif(not ON_HOPPER, reason="needs an sm_90 GPU")
needs_gluon = pytest.mark.skipif(th.gluon is None, reason="this Triton has no Gluon")
EPS = 1e-5


# ----------------------------------------------------------------------------------------------
# CPU
# ----------------------------------------------------------------------------------------------
@needs_gluon
@pytest.mark.parametrize("d, ffn, words", [(48, 128, "d_model and ffn_dim"), (128, 256, "d_model and ffn_dim"),
                                           (128, 128, "sm_90")])
def test_what_it_cannot_serve_is_named(d, ffn, words):
    why = th.why_unsupported(d, ffn, torch.device("cpu"))
    assert why is not None and words in why, why
    w = weights(d, ffn, torch.float16)
    x = torch.zeros(1, 2, d)
    with pytest.raises(ValueError, match="layer_tail_hopper: "):
        th.layer_tail_hopper(x.half(), x, w, eps=EPS)


def _bad_tail_inputs():
    """(what is wrong, the call's keyword changes, words the error names) for layer_tail_hopper's checks."""
    w = weights(32, 64, torch.float16)
    return [
        ("bf16 attention output", dict(o=torch.zeros(2, 3, 32, dtype=torch.bfloat16)), "share a float16/bfloat16"),
        ("fp64 residual", dict(x=torch.zeros(2, 3, 32, dtype=torch.float64)), "float32, float16 or bfloat16"),
        ("o of another shape", dict(o=torch.zeros(2, 4, 32, dtype=torch.float16)), "one shape"),
        ("a transposed weight", dict(w={**w, "o_w": w["o_w"].t()}), "weight o_w must be contiguous"),
        ("a mask of another shape", dict(mask=torch.ones(2, 4, dtype=torch.bool)), "mask must be bool"),
        ("a vector table of another width", dict(vecs=torch.zeros(7, 32)), "vecs must be"),
    ]


@pytest.mark.parametrize("what, change, words", _bad_tail_inputs(), ids=[c[0] for c in _bad_tail_inputs()])
def test_bad_inputs_are_named_before_any_launch(monkeypatch, what, change, words):
    """Past the device check (patched away here), each wrong argument is refused naming it."""
    monkeypatch.setattr(th, "why_unsupported", lambda *a: None)
    call = dict(o=torch.zeros(2, 3, 32, dtype=torch.float16), x=torch.zeros(2, 3, 32), w=weights(32, 64, torch.float16))
    call.update(change)
    with pytest.raises((ValueError, TypeError), match=words):
        th.layer_tail_hopper(call.pop("o"), call.pop("x"), call.pop("w"), eps=EPS, **call)


@pytest.mark.parametrize("what, x, w_change, vecs, words", [
    ("fp64 x", torch.zeros(2, 3, 32, dtype=torch.float64), {}, None, "float32, float16 or bfloat16"),
    ("a strided x", torch.zeros(2, 3, 64)[..., ::2], {}, None, "contiguous"),
    ("a transposed qkv_w", torch.zeros(2, 3, 32), {"qkv_w": torch.zeros(32, 96, dtype=torch.float16).t()}, None,
     "qkv_w must be a contiguous"),
    ("a vector table of another width", torch.zeros(2, 3, 32), {}, torch.zeros(5, 64), "vecs must be"),
])
def test_ln_qkv_bad_inputs_are_named_before_any_launch(monkeypatch, what, x, w_change, vecs, words):
    from shapewise.kernels import ln_qkv_hopper as qh

    monkeypatch.setattr(qh, "why_unsupported", lambda *a: None)
    with pytest.raises(ValueError, match=words):
        qh.ln_qkv_hopper(x, {**weights(32, 64, torch.float16), **w_change}, eps=EPS, vecs=vecs)


@pytest.mark.parametrize("n_tokens, programs, want", [(1, 132, 1), (5 * th.BLOCK_M, 132, 3),
                                                      (5 * th.BLOCK_M - 1, 132, 3), (1024 * th.BLOCK_M, 132, 132),
                                                      (1024 * th.BLOCK_M, 1, 1)])
def test_the_persistent_grid_keeps_each_program_two_blocks_busy(n_tokens, programs, want):
    assert th.persistent_grid(n_tokens, None, programs) == (want,)


@pytest.mark.parametrize("d", th.WIDTHS)
@pytest.mark.parametrize("ffn", th.WIDTHS)
def test_every_width_pair_fits_an_sm90_cta(d, ffn):
    assert th.shared_bytes(d, ffn) + 1024 <= th.SMEM_BYTES


def test_the_vector_table_rows_follow_the_order():
    w = weights(32, 64, torch.float16, seed=3)
    final = (torch.full((32,), 2.0), torch.full((32,), -1.0))
    table = th.tail_vectors({k: v.cpu() for k, v in w.items()}, final)
    assert table.shape == (len(th.VECTOR_ORDER), 64) and table.dtype == torch.float32
    rows = dict(zip(th.VECTOR_ORDER, table))
    assert torch.equal(rows["in_b"], w["in_b"].cpu().float())
    assert torch.equal(rows["o_b"][:32], w["o_b"].cpu().float()) and not rows["o_b"][32:].any()
    assert torch.equal(rows["final_w"][:32], final[0]) and torch.equal(rows["final_b"][:32], final[1])
    assert not th.tail_vectors({k: v.cpu() for k, v in w.items()})[th.VECTOR_ORDER.index("final_w")].any()


def test_the_qkv_vector_table_rows_follow_the_order():
    from shapewise.kernels import ln_qkv_hopper as qh

    w = {k: v.cpu() for k, v in weights(32, 64, torch.float16, seed=4).items()}
    rows = dict(zip(qh.VECTOR_ORDER, qh.qkv_vectors(w)))
    assert torch.equal(rows["n1_w"], w["n1_w"]) and torch.equal(rows["n1_b"], w["n1_b"])
    for i, name in enumerate(("q_b", "k_b", "v_b")):
        assert torch.equal(rows[name], w["qkv_b"][32 * i:32 * (i + 1)].float())


COMPILE = textwrap.dedent('''
    import json, re
    import torch
    from shapewise.kernels import layer_tail_hopper as th
    from shapewise.kernels import ln_qkv_hopper as qh
    from benchmarks.sm90 import compile_sm90, ptxas_report

    def build(d, f, dtype, mask, final, out):
        """The kernel for sm_90a as `layer_tail_hopper` launches it at these widths."""
        args = {"o_desc": th._descriptor(torch.zeros(256, d, dtype=dtype), th.BLOCK_M, d),
                "x_desc": th._descriptor(torch.zeros(256, d), th.BLOCK_M, d),
                "wo_desc": th._descriptor(torch.zeros(d, d, dtype=dtype), d, d),
                "win_desc": th._descriptor(torch.zeros(f, d, dtype=dtype), f, d),
                "wout_desc": th._descriptor(torch.zeros(d, f, dtype=dtype), d, f),
                "Y": out, "Mask": "*i8", "VEC": "*fp32", "eps": "fp32"}
        consts = dict(D=d, F=f, WIDTH=max(d, f), HAS_MASK=mask, FINAL_NORM=final,
                      CONSUMER_REGS=th.CONSUMER_REGISTERS, PRODUCER_REGS=th.PRODUCER_REGISTERS)
        names = th._layer_tail_hopper_fwd.arg_names  # 16-byte aligned pointers, as a launch specializes them
        attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in ("Y", "Mask", "VEC")}
        return compile_sm90(th._layer_tail_hopper_fwd, consts, args, th.kernel_options(), attrs)

    # (d, ffn, dtype, mask, final, out, spill bytes allowed): the d_model-128 layer with the mask and without the
    # final LayerNorm spills one register as a launch specializes it (a 4-byte store and load a block, in the 40.8 us
    # it was measured at)
    for d, f, dtype, mask, final, out, spill in [(128, 128, torch.float16, True, False, "*fp32", 8),
                                                 (128, 128, torch.float16, True, True, "*fp32", 0),
                                                 (64, 32, torch.bfloat16, False, True, "*bf16", 0),
                                                 (32, 128, torch.float16, False, False, "*fp32", 0)]:
        kernel = build(d, f, dtype, mask, final, out)
        assert kernel.metadata.shared <= th.shared_bytes(d, f) + 1024, kernel.metadata.shared
        report = ptxas_report(kernel)
        ptx = kernel.asm["ptx"]
        record = dict(d=d, ffn=f, dtype=str(dtype), shared_bytes=kernel.metadata.shared,
                      spill_bytes=report.spill_bytes,
                      setmaxnreg=sorted({int(n) for n in re.findall(r"setmaxnreg\\.inc\\.sync\\.aligned\\.u32\\s+(\\d+)", ptx)}))
        print("compiled", json.dumps(record), flush=True)
        assert kernel.asm["cubin"] and "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx, record
        assert record["spill_bytes"] <= spill and "serialized" not in report.text, (record, report.text)
        assert kernel.metadata.shared <= th.SMEM_BYTES, record
        assert th.CONSUMER_REGISTERS in record["setmaxnreg"], record

    for d, dtype, x_dtype in [(128, torch.float16, torch.float32), (64, torch.bfloat16, torch.bfloat16),
                              (32, torch.float16, torch.float16)]:
        args = {"x_desc": th._descriptor(torch.zeros(256, d, dtype=x_dtype), th.BLOCK_M, d),
                "w_desc": th._descriptor(torch.zeros(3 * d, d, dtype=dtype), d, d),
                "out_desc": th._descriptor(torch.zeros(256, 3 * d, dtype=dtype), th.BLOCK_M, d),
                "VEC": "*fp32", "eps": "fp32"}
        consts = dict(D=d, CONSUMER_REGS=th.CONSUMER_REGISTERS, PRODUCER_REGS=th.PRODUCER_REGISTERS)
        kernel = compile_sm90(qh._ln_qkv_hopper_fwd, consts, args, th.kernel_options())
        report = ptxas_report(kernel)
        record = dict(op="ln_qkv", d=d, dtype=str(dtype), shared_bytes=kernel.metadata.shared,
                      spill_bytes=report.spill_bytes)
        print("compiled", json.dumps(record), flush=True)
        assert record["spill_bytes"] == 0 and "serialized" not in report.text, (record, report.text)
        assert kernel.metadata.shared <= th.SMEM_BYTES, record
''')


@needs_gluon
def test_the_kernel_builds_for_sm90_without_spills():
    """Four width pairs, both operand dtypes, with and without the mask and the final LayerNorm, compile for sm_90a
    as a launch specializes them (16-byte aligned pointers) with no register spill beyond the one listed and no
    serialized wgmma, within an sm_90 CTA's shared memory; so does kernels/ln_qkv_hopper.py at three widths."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "workflow"), str(ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", COMPILE], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    print(done.stdout)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-6000:]
    assert done.stdout.count("compiled") == 7


# ----------------------------------------------------------------------------------------------
# GPU: against fp64
# ----------------------------------------------------------------------------------------------
# (B, S, d_model, ffn_dim): one block; ragged token counts (a last block cut short, an odd count of blocks so one
# consumer takes one more); the official d_model-128 layer at 8 192 tokens (several blocks per consumer)
GPU_SHAPES = [(1, 64, 128, 128), (3, 45, 64, 32), (2, 333, 32, 128), (5, 100, 128, 64), (8, 1024, 128, 128)]


def _inputs(B, S, d, ffn, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = weights(d, ffn, dtype, seed=seed)
    x = torch.randn(B, S, d, device="cuda", generator=g)
    o = torch.randn(B, S, d, device="cuda", generator=g).to(dtype)
    final = (1 + 0.1 * torch.randn(d, device="cuda", generator=g), 0.1 * torch.randn(d, device="cuda", generator=g))
    return o, x, w, final


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("last", [False, True], ids=["layer", "last-layer"])
@pytest.mark.parametrize("mask_kind", ["none", "holes", "one_empty"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("B, S, d, ffn", GPU_SHAPES, ids=str)
def test_kernel_matches_fp64(B, S, d, ffn, dtype, mask_kind, last):
    o, x, w, final = _inputs(B, S, d, ffn, dtype)
    mask = make_mask(mask_kind, B, S)
    mask = mask.cuda() if mask is not None else None
    norm = final if last else None
    y = th.layer_tail_hopper(o, x, w, eps=EPS, mask=mask, final=norm)
    assert y.dtype == torch.float32 and y.shape == (B, S, d)
    want = layer_tail_reference(o, x, w, eps=EPS, mask=mask, final=norm)
    atol, rtol = TOL[dtype]
    err = (y.double() - want).abs()
    assert torch.isfinite(y).all()
    assert not (err > atol + rtol * want.abs()).any(), f"max abs error {err.max().item():.3e}"
    if mask is not None and (~mask).any():
        assert y[~mask].abs().max().item() == 0.0, "invalid rows are not exactly zero"


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("num_programs", [1, 3])
def test_few_programs_take_every_block(num_programs):
    """One program (its two consumers taking every block in turn, each slot refilled many times) and three."""
    o, x, w, final = _inputs(3, 700, 128, 128, torch.float16, seed=2)
    y = th.layer_tail_hopper(o, x, w, eps=EPS, final=final, out_dtype=torch.float16, num_programs=num_programs)
    assert y.dtype == torch.float16
    want = layer_tail_reference(o, x, w, eps=EPS, final=final)
    atol, rtol = TOL[torch.float16]
    assert not ((y.double() - want).abs() > atol + rtol * want.abs()).any()


@pytest.mark.gpu
@needs_hopper
def test_the_vector_table_made_once_gives_the_same_output():
    o, x, w, final = _inputs(2, 200, 128, 128, torch.float16, seed=4)
    vecs = th.tail_vectors(w, final)
    assert torch.equal(th.layer_tail_hopper(o, x, w, eps=EPS, final=final, vecs=vecs),
                       th.layer_tail_hopper(o, x, w, eps=EPS, final=final))


# ----------------------------------------------------------------------------------------------
# GPU: the model's split layer with it
# ----------------------------------------------------------------------------------------------
@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("graph", [False, True], ids=["triton", "graph"])
@pytest.mark.parametrize("mask_kind", ["none", "all_true", "prefix", "holes"])
def test_the_split_layer_runs_it_where_the_policy_says_so(monkeypatch, mask_kind, graph):
    """Policy split_layer.hopper_tail_min_tokens and hopper_ln_qkv_min_tokens covering the shape: the triton route
    (eager) and the graph route (captured, its last tail after the replay) run every layer's tail and LayerNorm 1 +
    QKV (but the first's under a mask) as the Hopper kernels, within the official tolerance of an fp64 forward on
    every mask kind, and after a weight edit within it of the Triton kernels' forward (both switches off)."""
    from model_helpers import build_pair, cfg_of, check_official, cuda_case
    from shapewise.model import routing

    monkeypatch.setitem(routing.POLICY, "split_layer", {**routing.POLICY["split_layer"], "hopper_tail_min_tokens": 1,
                                                        "hopper_ln_qkv_min_tokens": 1})
    monkeypatch.setitem(routing.POLICY, "graph", {"max_tokens_x_d_model": 1 if not graph else 2**24,
                                                  "eager_tail_min_tokens_x_d_model": 1})
    cfg = cfg_of((3, 200, 128, 4, 64, 2))  # ragged token count (600) against the 64-token blocks
    opt, x, mask, want = cuda_case(cfg, mask_kind)
    with torch.inference_mode():
        got = opt(x, mask).cpu()
        again = opt(x, mask).cpu()  # a graph's replay
    route = opt.last_route
    assert route.name == ("graph" if graph else "triton") and route.split_layer, str(route)
    assert route.hopper_tail and route.hopper_ln_qkv, str(route)
    check_official(want, got, f"{route.name} route with the Hopper layer tail and LayerNorm + QKV, {mask_kind}")
    assert torch.equal(got, again)
    with torch.no_grad():  # a weight edit reaches the tail's vector table too
        opt.layers[1].ffn_out.bias.add_(0.5)
        opt.final_norm.bias.sub_(0.25)
    with torch.inference_mode():
        edited = opt(x, mask).cpu()
    _, off = build_pair(cfg, "auto", disable=("hopper_tail", "hopper_ln_qkv"))
    off.load_state_dict(opt.state_dict())
    with torch.inference_mode():
        reference = off.cuda()(x, mask).cpu()
    assert off.last_route.split_layer and not (off.last_route.hopper_tail or off.last_route.hopper_ln_qkv)
    check_official(reference, edited, f"the Hopper layer tail after a weight edit, {mask_kind}")


# ----------------------------------------------------------------------------------------------
# kernels/ln_qkv_hopper.py, the split layer's other Hopper kernel
# ----------------------------------------------------------------------------------------------
@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.float16], ids=["fp32-residual", "fp16-input"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("B, S, d, ffn", GPU_SHAPES, ids=str)
@pytest.mark.parametrize("num_programs", [None, 1])
def test_ln_qkv_matches_fp64(B, S, d, ffn, dtype, x_dtype, num_programs):
    from shapewise.kernels import ln_qkv_hopper as qh

    _, x, w, _ = _inputs(B, S, d, ffn, dtype, seed=6)
    x = x.to(x_dtype)
    got = qh.ln_qkv_hopper(x, w, eps=EPS, num_programs=num_programs)
    assert got.dtype == dtype and got.shape == (B, S, 3 * d)
    want = qh.qkv_reference(x, w, eps=EPS)
    atol, rtol = TOL[dtype]
    err = (got.double() - want).abs()
    assert not (err > atol + rtol * want.abs()).any(), f"max abs error {err.max().item():.3e}"


# ----------------------------------------------------------------------------------------------
# CPU: the split layer's plumbing around both kernels (each stood in for by its fp64 reference)
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mask_kind", ["none", "holes"])
def test_the_split_layers_plumbing_around_them(monkeypatch, mask_kind):
    """The triton route's split layer with both Hopper kernels (their fp64 references in their places): every
    layer's tail and every LayerNorm + QKV but the first's under a mask go to them, each with the vector table of
    its own layer (the last tail's with the final LayerNorm), also after a weight edit; the output within the
    official tolerance of an fp64 forward, the caller's x untouched."""
    import dataclasses

    from model_helpers import build_pair, cfg_of, check_official, fp64_forward, make_inputs
    from shapewise.kernels import ln_qkv_hopper as qh
    from shapewise.model import route_triton

    calls = []

    def tail(o, x, w, *, eps, mask=None, final=None, out_dtype=None, vecs=None):
        calls.append("tail+final" if final is not None else "tail")
        assert torch.equal(vecs, th.tail_vectors(w, final)), "a stale or another layer's vector table"
        return layer_tail_reference(o, x, w, eps=eps, mask=mask, final=final).to(out_dtype or torch.float32)

    def ln_qkv(x, w, *, eps, vecs=None):
        calls.append("ln_qkv")
        assert torch.equal(vecs, qh.qkv_vectors(w)), "a stale or another layer's vector table"
        return qh.qkv_reference(x, w, eps=eps).to(w["qkv_w"].dtype)

    monkeypatch.setattr(th, "layer_tail_hopper", tail)
    monkeypatch.setattr(qh, "ln_qkv_hopper", ln_qkv)
    cfg = cfg_of((2, 24, 32, 2, 64, 3))
    _, opt = build_pair(cfg, "triton")
    x, mask = make_inputs(cfg, mask_kind)
    with torch.inference_mode():
        opt(x, mask)
    route = dataclasses.replace(opt.last_route, hopper_tail=True, hopper_ln_qkv=True)
    assert route.split_layer, str(route)
    runner = route_triton.runner(opt, route)
    before = x.clone()
    for edit in (False, True):
        if edit:
            with torch.no_grad():
                opt.layers[2].ffn_out.bias.add_(0.5)
                opt.layers[1].norm1.weight.mul_(1.5)
                opt.final_norm.bias.sub_(0.25)
            opt.refresh_weights()
        calls.clear()
        with torch.inference_mode():
            got = runner(opt, x, mask)
        assert torch.equal(x, before)
        layers = cfg.num_layers
        assert calls.count("ln_qkv") == (layers - 1 if mask is not None else layers), calls
        assert calls[-1] == "tail+final" and calls.count("tail") == layers - 1, calls
        want = fp64_forward(opt.state_dict(), cfg, x, mask).nan_to_num(0.0).float()
        check_official(want, got, f"the split layer with the Hopper kernels' references, {mask_kind}, edit {edit}")
