"""kernels.fused_linear against fp64 references written in plain torch: every prologue/epilogue combination on
shapes off the blocks, the LayerNorm statistics its epilogue leaves against torch's mean and variance, the folded
LayerNorm, a layer's chain of calls, and the errors of bad inputs."""

import itertools

import pytest
import torch

from shapewise.kernels import fused_linear as fl

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
EPS = 1e-5
SMALL = dict(block_m=32, block_n=32, block_k=32)  # several blocks and their edges on interpreter-sized shapes
# out dtype -> (atol, rtol) against the reference with the operand rounded as the kernel rounds it: what is left is
# fp32 accumulation (~1e-6 at these K), a rare one-ulp difference of a normalized operand (fp32 against fp64
# arithmetic before the rounding: an ulp of up to 2^-9 at |a| < 4 times |w| < 0.25, ~5e-4 in y) and the output's
# rounding (fp16 2^-11, bf16 2^-8 relative).
TOL = {torch.float32: (5e-4, 1e-5), torch.float16: (5e-4, 1e-3), torch.bfloat16: (1e-3, 8e-3)}


def make(m, n, k, *, seed=0, device=DEVICE, offset=0.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * 1.5 + offset  # the residual stream the prologue normalizes
    a = torch.randn(m, k, generator=g).half()
    w = (torch.randn(n, k, generator=g) / k**0.5).half()
    bias = 0.1 * torch.randn(n, generator=g)
    residual = torch.randn(m, n, generator=g) + 0.5
    row_mask = torch.rand(m, generator=g) > 0.3
    return {name: t.to(device) for name, t in dict(x=x, a=a, w=w, bias=bias, residual=residual,
                                                    row_mask=row_mask).items()}


def row_stats(x):
    """fp32 (mean, rstd) of x's rows, computed in fp64: the prologue's input."""
    mean, rstd = fl.layernorm_stats_reference(x, eps=EPS)
    return mean.float(), rstd.float()


SHAPES = [(70, 48, 80), (1, 16, 16), (33, 144, 96), (64, 32, 64)]  # M, N, K: edges in M, N and K, and none
COMBOS = list(itertools.product((False, True), repeat=5))  # ln, gelu, residual, row_mask, stats


@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
@pytest.mark.parametrize("ln,gelu,residual,row_mask,stats", COMBOS,
                         ids=lambda v: "1" if v is True else "0" if v is False else str(v))
def test_each_combination(ln, gelu, residual, row_mask, stats, tma, assert_close):
    m, n, k = 70, 48, 80
    t = make(m, n, k, seed=sum(2**i * v for i, v in enumerate((ln, gelu, residual, row_mask, stats))))
    a = t["x"] if ln else t["a"]
    kw = dict(ln=row_stats(t["x"]) if ln else None, gelu=gelu, residual=t["residual"] if residual else None,
              row_mask=t["row_mask"] if row_mask else None)
    out_dtype = torch.float32 if residual else torch.float16
    st = torch.full(fl.stats_shape(m, n, SMALL["block_n"]), float("nan"), device=DEVICE) if stats else None
    y = fl.fused_linear(a, t["w"], t["bias"], stats_out=st, out_dtype=out_dtype, tma=tma, **kw, **SMALL)
    assert y.dtype == out_dtype and y.shape == (m, n)
    want = fl.fused_linear_reference(a, t["w"], t["bias"], **kw)
    atol, rtol = TOL[out_dtype]
    assert_close(y, want, atol=atol, rtol=rtol, what=f"y ln={ln} gelu={gelu} residual={residual} mask={row_mask}")
    if row_mask:
        assert y.cpu()[~t["row_mask"].cpu()].abs().max().item() == 0.0, "rows of a False row_mask are not 0"
    if stats:
        mean, rstd = fl.layernorm_stats(st, n, eps=EPS, block_n=SMALL["block_n"])
        ref_mean, ref_rstd = fl.layernorm_stats_reference(want, eps=EPS)  # of y before its cast to out_dtype
        assert_close(mean, ref_mean, atol=1e-5, rtol=1e-5, what="merged mean")
        assert_close(rstd, ref_rstd, atol=0, rtol=1e-4, what="merged rstd")


@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("out_dtype", fl.OUT_DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_shapes_and_out_dtypes(m, n, k, out_dtype, assert_close):
    t = make(m, n, k, seed=m * 7 + n + k)
    y = fl.fused_linear(t["a"], t["w"], t["bias"], gelu=True, out_dtype=out_dtype, **SMALL)
    atol, rtol = TOL[out_dtype]
    assert_close(y, fl.fused_linear_reference(t["a"], t["w"], t["bias"], gelu=True), atol=atol, rtol=rtol,
                 what=f"y {m}x{n}x{k} {out_dtype}")


@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
def test_default_launch(tma, assert_close):
    """The Hopper tile (128 x 128 x 64): one partial row block, one partial column block, a K edge."""
    m, n, k = 130, 144, 80
    t = make(m, n, k, seed=5)
    st = torch.empty(fl.stats_shape(m, n), device=DEVICE)
    y = fl.fused_linear(t["x"], t["w"], t["bias"], ln=row_stats(t["x"]), residual=t["residual"],
                        row_mask=t["row_mask"], stats_out=st, out_dtype=torch.float32, tma=tma)
    want = fl.fused_linear_reference(t["x"], t["w"], t["bias"], ln=row_stats(t["x"]), residual=t["residual"],
                                     row_mask=t["row_mask"])
    assert_close(y, want, atol=5e-4, rtol=1e-5, what="default launch")
    mean, rstd = fl.layernorm_stats(st, n, eps=EPS)
    ref_mean, ref_rstd = fl.layernorm_stats_reference(want, eps=EPS)
    assert_close(mean, ref_mean, atol=1e-5, rtol=1e-5, what="default launch mean")
    assert_close(rstd, ref_rstd, atol=0, rtol=1e-4, what="default launch rstd")


@pytest.mark.parametrize("n,block_n", [(80, 32), (48, 16), (144, 128), (32, 64)])
def test_statistics_merge_against_torch(n, block_n, assert_close):
    """Partials over blocks of block_n columns (the last narrower where N is not a multiple) merged into the rows'
    mean and variance, checked against torch.mean / torch.var in fp64; rows with a mean of 1000 keep their variance
    (a one-pass E[y^2] - E[y]^2 in fp32 would lose it) and a constant row has variance 0."""
    m, k = 37, 32
    t = make(m, n, k, seed=n + block_n)
    residual = t["residual"].clone()
    residual[::3] += 1000.0
    w = t["w"].clone()
    w[5] = 0  # with a constant residual row, y's row 5 is constant ...
    residual[5] = 2.0
    bias = t["bias"].clone()
    bias[:] = 0.25  # ... bias and all
    st = torch.empty(fl.stats_shape(m, n, block_n), device=DEVICE)
    a = t["a"].clone()
    a[5] = 0
    y = fl.fused_linear(a, w, bias, residual=residual, stats_out=st, out_dtype=torch.float32,
                        block_m=32, block_n=block_n, block_k=32)
    mean, rstd = fl.layernorm_stats(st, n, eps=EPS, block_n=block_n)
    y64 = y.cpu().double()
    var = torch.var(y64, dim=-1, unbiased=False)
    assert_close(mean, torch.mean(y64, dim=-1), atol=1e-5, rtol=1e-6, what="mean")
    assert_close(rstd, 1.0 / torch.sqrt(var + EPS), atol=0, rtol=1e-4, what="rstd")
    assert y64[5].std().item() == 0.0 and rstd.cpu()[5].item() == pytest.approx(EPS**-0.5, rel=1e-6)
    again = torch.empty_like(st)
    fl.fused_linear(a, w, bias, residual=residual, stats_out=again, out_dtype=torch.float32,
                    block_m=32, block_n=block_n, block_k=32)
    assert torch.equal(again, st), "the partial statistics differ between two identical calls"


def test_fold_layernorm(assert_close):
    """LayerNorm(x) @ w.T + bias, the LayerNorm's gamma and beta folded into w and bias, against torch's LayerNorm
    in fp64; the folded weight is rounded to fp16 once, so the tolerance is that of an fp16 operand."""
    m, n, k = 45, 64, 96
    t = make(m, n, k, seed=3, offset=2.0)
    g = torch.Generator().manual_seed(4)
    gamma = (1 + 0.3 * torch.randn(k, generator=g)).to(DEVICE)
    beta = (0.2 * torch.randn(k, generator=g)).to(DEVICE)
    w2, b2 = fl.fold_layernorm(t["w"], t["bias"], gamma, beta)
    assert w2.dtype == torch.float16 and b2.dtype == torch.float32
    assert_close(b2, t["bias"].double() + t["w"].double() @ beta.double(), atol=1e-6, rtol=1e-6, what="folded bias")
    y = fl.fused_linear(t["x"], w2, b2, ln=row_stats(t["x"]), out_dtype=torch.float32, **SMALL)
    x64 = t["x"].cpu().double()
    h = torch.nn.functional.layer_norm(x64, (k,), gamma.cpu().double(), beta.cpu().double(), EPS)
    want = h @ t["w"].cpu().double().t() + t["bias"].cpu().double()
    assert_close(y, want, atol=5e-3, rtol=5e-3, what="folded LayerNorm + linear")


def test_layer_chain(assert_close):
    """A pre-LayerNorm FFN block as the kernels would run it: residual + stats from one call, merged, then the next
    call's LayerNorm prologue with GELU, then the residual add with the row mask; against fp64 torch."""
    m, d, f = 41, 48, 64
    t = make(m, d, d, seed=9)
    g = torch.Generator().manual_seed(10)
    w_in = (torch.randn(f, d, generator=g) / d**0.5).half().to(DEVICE)
    b_in = (0.1 * torch.randn(f, generator=g)).to(DEVICE)
    w_out = (torch.randn(d, f, generator=g) / f**0.5).half().to(DEVICE)
    b_out = (0.1 * torch.randn(d, generator=g)).to(DEVICE)
    gamma = (1 + 0.2 * torch.randn(d, generator=g)).to(DEVICE)
    beta = (0.1 * torch.randn(d, generator=g)).to(DEVICE)
    st = torch.empty(fl.stats_shape(m, d, 32), device=DEVICE)
    res = fl.fused_linear(t["a"], t["w"], t["bias"], residual=t["residual"], stats_out=st, out_dtype=torch.float32,
                          **SMALL)
    w_in2, b_in2 = fl.fold_layernorm(w_in, b_in, gamma, beta)
    h = fl.fused_linear(res, w_in2, b_in2, ln=fl.layernorm_stats(st, d, eps=EPS, block_n=32), gelu=True, **SMALL)
    out = fl.fused_linear(h, w_out, b_out, residual=res, row_mask=t["row_mask"], out_dtype=torch.float32, **SMALL)
    c = {k: v.cpu().double() for k, v in dict(a=t["a"], w=t["w"], b=t["bias"], r=t["residual"], wi=w_in, bi=b_in,
                                              wo=w_out, bo=b_out, g=gamma, be=beta).items()}
    r1 = c["a"] @ c["w"].t() + c["b"] + c["r"]
    hh = torch.nn.functional.gelu(torch.nn.functional.layer_norm(r1, (d,), c["g"], c["be"], EPS) @ c["wi"].t()
                                  + c["bi"])
    want = (r1 + hh @ c["wo"].t() + c["bo"]) * t["row_mask"].cpu()[:, None]
    assert_close(out, want, atol=1e-2, rtol=1e-2, what="FFN block from fused calls")


def test_out_may_be_the_residual(assert_close):
    m, n, k = 40, 48, 32
    t = make(m, n, k, seed=11)
    want = fl.fused_linear_reference(t["a"], t["w"], t["bias"], residual=t["residual"])
    res = t["residual"].clone()
    y = fl.fused_linear(t["a"], t["w"], t["bias"], residual=res, out=res, out_dtype=torch.float32, **SMALL)
    assert y.data_ptr() == res.data_ptr()
    assert_close(res, want, atol=1e-4, rtol=1e-5, what="in-place residual")


def test_strided_a(assert_close):
    """a may be a column slice of a wider tensor (row stride > K)."""
    m, n, k = 20, 32, 48
    t = make(m, n, k, seed=12)
    wide = torch.randn(m, 2 * k, device=DEVICE).half()
    a = wide[:, k:]
    y = fl.fused_linear(a, t["w"], t["bias"], **SMALL)
    assert_close(y, fl.fused_linear_reference(a, t["w"], t["bias"]), atol=2e-4, rtol=1e-3, what="strided a")


def _bad_inputs():
    m, n, k = 8, 32, 48
    t = make(m, n, k, seed=13)
    ok = dict(a=t["a"], w=t["w"], bias=t["bias"])
    stats = row_stats(t["x"])
    return [
        ("a", dict(ok, a=t["a"].float())),  # fp32 operand without the prologue
        ("a", dict(ok, a=t["a"][0])),
        ("w", dict(ok, w=t["w"][:, :32])),
        ("w", dict(ok, w=t["w"].float())),
        ("K (a's columns)", dict(ok, a=t["a"][:, :40], w=t["w"][:, :40])),
        ("N (w's rows)", dict(ok, w=t["w"][:24], bias=t["bias"][:24])),
        ("bias", dict(ok, bias=t["bias"][:16])),
        ("bias", dict(ok, bias=t["bias"].double())),
        ("ln mean", dict(ok, ln=(stats[0][:4], stats[1]))),
        ("ln rstd", dict(ok, ln=(stats[0], stats[1].double()))),
        ("ln must be a pair", dict(ok, ln=stats[0])),
        ("residual", dict(ok, residual=t["residual"].half(), out_dtype=torch.float32)),
        ("residual", dict(ok, residual=t["residual"][:, :16], out_dtype=torch.float32)),
        ("residual", dict(ok, residual=t["residual"].t().contiguous().t(), out_dtype=torch.float32)),
        ("row_mask", dict(ok, row_mask=t["row_mask"].to(torch.int8))),
        ("row_mask", dict(ok, row_mask=t["row_mask"][:3])),
        ("stats_out", dict(ok, stats_out=torch.empty(m, 2, 2, device=DEVICE))),
        ("stats_out", dict(ok, stats_out=torch.empty(m, 2, 4, device=DEVICE)[..., :2], block_n=16)),
        ("out_dtype", dict(ok, out_dtype=torch.float64)),
        ("out", dict(ok, out=torch.empty(m, n, device=DEVICE), out_dtype=torch.float16)),
        ("block_n", dict(ok, block_n=48)),
        ("with tma=True, a", dict(ok, a=torch.empty(m, k + 8, device=DEVICE).half()[:, 1:k + 1], tma=True)),
        ("with tma=True, w", dict(ok, w=torch.empty(n, k + 4, device=DEVICE).half()[:, :k], tma=True)),
    ]


@pytest.mark.parametrize("index", range(len(_bad_inputs())))
def test_bad_inputs_name_the_tensor(index):
    name, kw = _bad_inputs()[index]
    with pytest.raises(ValueError, match="fused_linear: " + name.replace("(", r"\(").replace(")", r"\)")):
        fl.fused_linear(**kw)


def test_bad_statistics_and_fold_inputs():
    st = torch.empty(fl.stats_shape(8, 80, 32))
    with pytest.raises(ValueError, match=r"stats must be contiguous fp32 of shape \[8, 5, 2\]"):
        fl.layernorm_stats(st, 80, eps=EPS, block_n=16)
    with pytest.raises(ValueError, match="stats must be a 3-D tensor"):
        fl.layernorm_stats(st[0], 80, eps=EPS)
    w, b = torch.zeros(16, 32).half(), torch.zeros(16)
    with pytest.raises(ValueError, match="gamma"):
        fl.fold_layernorm(w, b, torch.ones(16), torch.zeros(32))
    with pytest.raises(ValueError, match="bias"):
        fl.fold_layernorm(w, b[:8], torch.ones(32), torch.zeros(32))


@pytest.mark.gpu
def test_row8_sized_on_gpu(assert_close):
    """Official row 8's GEMM (8192 tokens, d_model 1024) at the default launch on a CUDA device, every prologue and
    epilogue at once and each alone, against the fp64 reference."""
    cuda = torch.device("cuda")
    m, n, k = 8192, 1024, 1024
    t = make(m, n, k, seed=8, device=cuda)
    ln = row_stats(t["x"])
    for tma in (False, True):
        for kw, a, out_dtype in [(dict(), t["a"], torch.float16), (dict(gelu=True), t["a"], torch.float16),
                                 (dict(ln=ln), t["x"], torch.float16),
                                 (dict(ln=ln, gelu=True, residual=t["residual"], row_mask=t["row_mask"]), t["x"],
                                  torch.float32)]:
            y = fl.fused_linear(a, t["w"], t["bias"], out_dtype=out_dtype, tma=tma, **kw)
            atol, rtol = TOL[out_dtype]
            assert_close(y, fl.fused_linear_reference(a, t["w"], t["bias"], **kw), atol=atol * 5, rtol=rtol,
                         what=f"row 8 {sorted(kw)} tma={tma}")
    st = torch.empty(fl.stats_shape(m, n), device=cuda)
    y = fl.fused_linear(t["a"], t["w"], t["bias"], residual=t["residual"], stats_out=st, out_dtype=torch.float32)
    mean, rstd = fl.layernorm_stats(st, n, eps=EPS)
    y64 = y.double()
    assert_close(mean, y64.mean(-1), atol=1e-5, rtol=1e-6, what="row 8 mean")
    assert_close(rstd, 1.0 / torch.sqrt(y64.var(-1, unbiased=False) + EPS), atol=0, rtol=1e-4, what="row 8 rstd")
