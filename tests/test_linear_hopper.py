"""kernels/linear_hopper.py: its reference and launch checks (CPU), its sm_90a build at every epilogue (offline, no
GPU: a cubin, no register spills, no serialized wgmma, shared memory within the 227 KB of an sm_90 CTA), and on a
Hopper GPU the kernel against fp64 on ragged shapes (M, N, K off the tiles), both operand dtypes, every epilogue,
one program and several, the residual epilogue writing over its residual, rows zeroed by a row mask, and the model's
triton and graph routes with it on every mask kind."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from shapewise.kernels import linear_hopper as lh

ROOT = Path(__file__).resolve().parent.parent
ON_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
needs_hopper = pytest.mark.skipif(not ON_HOPPER, reason="needs an sm_90 GPU")
needs_gluon = pytest.mark.skipif(lh.gluon is None, reason="this Triton has no Gluon")

# output dtype -> (atol, rtol) of the project's rule (|diff| <= atol or <= rtol |expected|) for outputs of O(1):
# 16-bit outputs round to 11 (fp16) or 8 (bf16) bits, fp16/bf16 operands likewise; fp32 outputs keep the
# operands' rounding only
TOL = {torch.float16: (4e-3, 4e-3), torch.bfloat16: (3e-2, 2e-2), torch.float32: (4e-3, 4e-3)}


# ----------------------------------------------------------------------------------------------
# CPU: reference and launch checks
# ----------------------------------------------------------------------------------------------
def test_the_reference_is_the_linear_layer_and_its_epilogues():
    torch.manual_seed(0)
    a, w, b, r = torch.randn(5, 8), torch.randn(3, 8), torch.randn(3), torch.randn(5, 3)
    y = torch.nn.functional.linear(a.double(), w.double(), b.double())
    assert torch.allclose(lh.linear_reference(a, w, b), y)
    assert torch.allclose(lh.linear_reference(a, w, b, epilogue="gelu"), torch.nn.functional.gelu(y))
    assert torch.allclose(lh.linear_reference(a, w, b, epilogue="residual", residual=r), r.double() + y)
    keep = torch.tensor([True, False, True, True, False])
    masked = lh.linear_reference(a, w, b, epilogue="residual", residual=r, row_mask=keep)
    assert torch.equal(masked[~keep], torch.zeros(2, 3, dtype=torch.float64))
    assert torch.allclose(masked[keep], (r.double() + y)[keep])


@needs_gluon
@pytest.mark.parametrize("a, w, epilogue, words", [
    (torch.zeros(4, 16, dtype=torch.float32), torch.zeros(8, 16), "bias", "float16/bfloat16"),
    (torch.zeros(4, 16, dtype=torch.float16), torch.zeros(8, 16, dtype=torch.bfloat16), "bias", "share"),
    (torch.zeros(4, 16, dtype=torch.float16), torch.zeros(8, 8, dtype=torch.float16), "bias", "[M, K]"),
    (torch.zeros(4, 12, dtype=torch.float16), torch.zeros(8, 12, dtype=torch.float16), "bias", "multiples of 8"),
    (torch.zeros(4, 16, dtype=torch.float16), torch.zeros(8, 16, dtype=torch.float16), "relu", "epilogue"),
    (torch.zeros(4, 16, dtype=torch.float16), torch.zeros(8, 16, dtype=torch.float16), "bias", "sm_90"),
])
def test_what_it_cannot_serve_is_named(a, w, epilogue, words):
    why = lh.why_unsupported(a, w, epilogue, torch.device("cpu"))
    assert why is not None and words in why, why
    with pytest.raises(ValueError, match="linear_hopper: "):
        lh.linear_hopper(a, w, torch.zeros(w.shape[0]), epilogue=epilogue)


@pytest.mark.parametrize("out_dtype", [torch.float16, torch.float32])
def test_each_launch_fits_an_sm90_ctas_shared_memory(out_dtype):
    assert lh.shared_bytes(out_dtype) + 1024 <= lh.SMEM_BYTES  # the mbarriers and alignment within 1 KB
    assert lh.stages_for(out_dtype) >= 3  # two blocks in flight beside the one the wgmma reads


@pytest.mark.parametrize("mask_kind", ["none", "all_true", "prefix", "holes"])
def test_the_unfused_layers_plumbing_around_it(monkeypatch, mask_kind):
    """The triton route's layers with `hopper_linear` (CPU, the kernel's contract computed in torch as it rounds):
    the official tolerance against an fp64 forward on every mask kind, the caller's x untouched."""
    import dataclasses

    from model_helpers import build_pair, cfg_of, check_official, fp64_forward, make_inputs
    from shapewise.model import route_triton

    from benchmarks.epilogue_precision import linear_as_the_kernel_rounds

    monkeypatch.setattr(lh, "linear_hopper", linear_as_the_kernel_rounds)
    cfg = cfg_of((2, 24, 32, 2, 40, 2))
    _, opt = build_pair(cfg, "triton")
    x, mask = make_inputs(cfg, mask_kind)
    with torch.inference_mode():
        opt(x, mask)  # the route as the model settles it, then the same with the Hopper linear layers
        runner = route_triton.KernelForward(opt, dataclasses.replace(opt.last_route, hopper_linear=True))
        before = x.clone()
        got = runner(opt, x, mask)
    assert torch.equal(x, before)
    want = fp64_forward(opt.state_dict(), cfg, x, mask).nan_to_num(0.0).float()
    check_official(want, got, f"the triton route's layers with hopper_linear, {mask_kind}")


# ----------------------------------------------------------------------------------------------
# CPU: the sm_90a build (Triton's compiler and ptxas, no GPU)
# ----------------------------------------------------------------------------------------------
COMPILE = textwrap.dedent('''
    import json, re
    import torch
    from shapewise.kernels import linear_hopper as lh
    from benchmarks.sm90 import compile_sm90, ptxas_report

    def build(epilogue, dtype):
        """The kernel for sm_90a at the launch `linear_hopper` makes for this epilogue and operand dtype."""
        out_dtype = torch.float32 if epilogue == "residual" else dtype
        a, w, c = torch.zeros(256, 128, dtype=dtype), torch.zeros(256, 128, dtype=dtype), torch.zeros(256, 256,
                                                                                                       dtype=out_dtype)
        args = {"a_desc": lh._descriptor(a, lh.BLOCK_M, lh.BLOCK_K), "w_desc": lh._descriptor(w, lh.BLOCK_N, lh.BLOCK_K),
                "c_desc": lh._descriptor(c, lh.BLOCK_M, lh.BLOCK_N), "r_desc": lh._descriptor(c, lh.BLOCK_M, lh.BLOCK_N),
                "bias_ptr": "*fp16", "mask_ptr": "*i8"}
        consts = dict(STAGES=lh.stages_for(out_dtype), EPILOGUE=lh.EPILOGUES.index(epilogue),
                      ROW_MASK=epilogue == "residual", CONSUMER_REGS=lh.CONSUMER_REGISTERS, PRODUCER_REGS=lh.PRODUCER_REGISTERS)
        return compile_sm90(lh._linear_hopper_fwd, consts, args, lh.kernel_options())

    for epilogue in lh.EPILOGUES:
        for dtype in (torch.float16, torch.bfloat16):
            kernel = build(epilogue, dtype)
            report = ptxas_report(kernel)
            ptx = kernel.asm["ptx"]
            record = dict(epilogue=epilogue, dtype=str(dtype), shared_bytes=kernel.metadata.shared,
                          spill_bytes=report.spill_bytes,
                          setmaxnreg=sorted({int(n) for n in re.findall(r"setmaxnreg\\.inc\\.sync\\.aligned\\.u32\\s+(\\d+)", ptx)}))
            print("compiled", json.dumps(record), flush=True)
            assert kernel.asm["cubin"] and "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx, record
            assert record["spill_bytes"] == 0 and "serialized" not in report.text, (record, report.text)
            assert kernel.metadata.shared <= lh.SMEM_BYTES, record
            assert lh.CONSUMER_REGISTERS in record["setmaxnreg"], record
''')


@needs_gluon
def test_the_kernel_builds_for_sm90_without_spills():
    """Every epilogue and operand dtype compiles for sm_90a with no register spill and no serialized wgmma, within
    an sm_90 CTA's shared memory; the records printed (pytest -s) give the shared bytes and the partitions'
    setmaxnreg."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "workflow"), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", COMPILE], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    print(done.stdout)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-6000:]
    assert done.stdout.count("compiled") == 2 * len(lh.EPILOGUES)


# ----------------------------------------------------------------------------------------------
# GPU: against fp64
# ----------------------------------------------------------------------------------------------
# (M, N, K): one tile, ragged M, N and K (N and K multiples of 8, TMA's rule), K shorter than a block, and several
# tiles per program with an odd count per consumer
GPU_SHAPES = [(128, 128, 64), (300, 136, 200), (1, 8, 8), (1000, 520, 1032), (4096, 1024, 1024)]


def _operands(M, N, K, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn(M, K, device="cuda", generator=g).to(dtype)
    w = (torch.randn(N, K, device="cuda", generator=g) * K**-0.5).to(dtype)
    b = torch.randn(N, device="cuda", generator=g).to(dtype)
    r = torch.randn(M, N, device="cuda", generator=g)
    return a, w, b, r


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("epilogue", lh.EPILOGUES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("M, N, K", GPU_SHAPES, ids=str)
def test_kernel_matches_fp64(M, N, K, dtype, epilogue, assert_close):
    a, w, b, r = _operands(M, N, K, dtype)
    got = lh.linear_hopper(a, w, b, epilogue=epilogue, residual=r)
    want = lh.linear_reference(a, w, b, epilogue=epilogue, residual=r)
    assert got.dtype == (torch.float32 if epilogue == "residual" else dtype)
    atol, rtol = TOL[got.dtype]
    assert_close(got.double(), want, atol=atol, rtol=rtol, what=f"linear_hopper {epilogue} {dtype} {(M, N, K)}")


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("num_programs", [1, 3])
def test_few_programs_take_every_tile(num_programs, assert_close):
    """One program (every tile on its two consumers in turn, the ring wrapping many times) and three."""
    a, w, b, r = _operands(1000, 520, 1032, torch.float16, seed=1)
    got = lh.linear_hopper(a, w, b, epilogue="gelu", num_programs=num_programs)
    assert_close(got.double(), lh.linear_reference(a, w, b, epilogue="gelu"), atol=4e-3, rtol=4e-3,
                 what=f"linear_hopper gelu on {num_programs} programs")


def test_ring_depths_that_fit():
    assert lh.shared_bytes(torch.float16, 5) + 1024 <= lh.SMEM_BYTES  # 5 x 32 KB + 2 x 32 KB
    assert lh.shared_bytes(torch.float32, 4) + 1024 > lh.SMEM_BYTES  # 4 x 32 KB + 2 x 64 KB


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("epilogue, stages", [("bias", 2), ("gelu", 5), ("residual", 2)])
def test_other_ring_depths(epilogue, stages, assert_close):
    """The ring at other depths than the default (the tiles' blocks wrap around it at another period)."""
    a, w, b, r = _operands(1000, 520, 1032, torch.float16, seed=5)
    got = lh.linear_hopper(a, w, b, epilogue=epilogue, residual=r, stages=stages, num_programs=3)
    assert_close(got.double(), lh.linear_reference(a, w, b, epilogue=epilogue, residual=r), atol=4e-3, rtol=4e-3,
                 what=f"linear_hopper {epilogue} with {stages} ring slots")
    with pytest.raises(ValueError, match="ring slots"):
        lh.linear_hopper(a, w, b, epilogue="residual", residual=r, stages=4)


@pytest.mark.gpu
@needs_hopper
def test_the_residual_epilogue_may_write_over_its_residual(assert_close):
    a, w, b, r = _operands(1000, 520, 1032, torch.float16, seed=2)
    want = lh.linear_reference(a, w, b, epilogue="residual", residual=r)
    got = lh.linear_hopper(a, w, b, epilogue="residual", residual=r, out=r)
    assert got.data_ptr() == r.data_ptr()
    assert_close(got.double(), want, atol=4e-3, rtol=4e-3, what="linear_hopper residual in place")


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("epilogue", lh.EPILOGUES)
def test_rows_of_invalid_tokens_become_zero(epilogue, assert_close):
    """A row mask with ragged runs of invalid rows, across tiles and inside one; the residual in place."""
    a, w, b, r = _operands(1000, 520, 1032, torch.float16, seed=3)
    keep = torch.rand(1000, device="cuda", generator=torch.Generator(device="cuda").manual_seed(4)) > 0.3
    keep[128:300] = False
    want = lh.linear_reference(a, w, b, epilogue=epilogue, residual=r, row_mask=keep)
    got = lh.linear_hopper(a, w, b, epilogue=epilogue, residual=r, row_mask=keep,
                           out=r if epilogue == "residual" else None)
    assert torch.equal(got[~keep], torch.zeros_like(got[~keep]))
    assert_close(got.double(), want, atol=4e-3, rtol=4e-3, what=f"linear_hopper {epilogue} with a row mask")
    with pytest.raises(ValueError, match="row_mask must be bool with 1000 elements"):
        lh.linear_hopper(a, w, b, epilogue=epilogue, residual=r, row_mask=keep[:999])


# ----------------------------------------------------------------------------------------------
# GPU: the model's triton and graph routes with it
# ----------------------------------------------------------------------------------------------
@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("graph", [False, True], ids=["triton", "graph"])
@pytest.mark.parametrize("mask_kind", ["none", "all_true", "prefix", "holes"])
def test_the_unfused_layer_runs_it_where_the_policy_says_so(monkeypatch, mask_kind, graph):
    """Policy hopper_linear.min_d_model covering the shape: the triton route (eager) and the graph route (captured)
    run the out-projection and the FFN as the Hopper GEMM, GELU in FFN-in's epilogue, within the official tolerance
    of an fp64 forward on every mask kind; the switch off runs cuBLAS."""
    from model_helpers import build_pair, cfg_of, check_official, cuda_case
    from shapewise.model import routing

    monkeypatch.setitem(routing.POLICY, "hopper_linear", {"min_d_model": 256})
    if not graph:
        monkeypatch.setitem(routing.POLICY, "graph", {"max_tokens_x_d_model": 1})
    cfg = cfg_of((3, 200, 256, 4, 520, 2))  # ragged token count (600) and FFN width (520) against the tiles
    opt, x, mask, want = cuda_case(cfg, mask_kind)
    with torch.inference_mode():
        got = opt(x, mask).cpu()
        again = opt(x, mask).cpu()  # a graph's replay
    route = opt.last_route
    assert route.name == ("graph" if graph else "triton") and route.hopper_linear, str(route)
    check_official(want, got, f"{route.name} route with the Hopper linear layers, {mask_kind}")
    assert torch.equal(got, again)
    _, off = build_pair(cfg, "auto", disable=("hopper_linear",))
    off.load_state_dict(opt.state_dict())
    with torch.inference_mode():
        check_official(want, off.cuda()(x, mask).cpu(), f"hopper_linear off, {mask_kind}")
    assert not off.last_route.hopper_linear, str(off.last_route)
