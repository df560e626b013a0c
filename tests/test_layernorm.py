"""kernels.layernorm.add_layernorm / layer_norm against an fp64 LayerNorm written here in plain torch."""

import itertools

import pytest
import torch

from shapewise.kernels.layernorm import add_layernorm, layer_norm

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
WIDTHS = (32, 80, 128, 1000, 1024)
OUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# out dtype -> (atol, rtol) for the normalized output (values ~N(0,1) * weight + bias): fp32 stats over up to
# 1024 elements are good to ~1e-6; fp16 output rounds at 2^-11, bf16 at 2^-8.
NORM_TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (2e-3, 1e-3), torch.bfloat16: (1.6e-2, 8e-3)}
EPS = 1e-5


def ref_layernorm(x, weight, bias, eps=EPS):
    x = x.detach().to("cpu", torch.float64)
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * weight.detach().cpu().double() + bias.detach().cpu().double()


def make(rows, width, branch_dtype=torch.float32, scale=1.0):
    g = torch.Generator().manual_seed(rows * 7919 + width)
    residual = (torch.randn(rows, width, generator=g) * scale + 0.5).to(DEVICE)
    branch = (torch.randn(rows, width, generator=g) * scale).to(DEVICE, branch_dtype)
    weight = (1.0 + 0.3 * torch.randn(width, generator=g)).to(DEVICE)
    bias = (0.2 * torch.randn(width, generator=g)).to(DEVICE)
    return residual, branch, weight, bias


@pytest.mark.parametrize("width,out_dtype", list(itertools.product(WIDTHS, OUT_DTYPES)),
                         ids=lambda v: str(v).replace("torch.", ""))
def test_add_layernorm(width, out_dtype, assert_close):
    residual, branch, weight, bias = make(7, width)
    r_before, b_before = residual.clone(), branch.clone()
    new_res, normed = add_layernorm(residual, branch, weight, bias, eps=EPS, out_dtype=out_dtype)
    assert new_res.dtype == torch.float32 and normed.dtype == out_dtype
    assert new_res.shape == residual.shape and normed.shape == residual.shape
    expected_res = residual.double().cpu() + branch.double().cpu()
    assert_close(new_res, expected_res, atol=1e-6, rtol=1e-6, what=f"new_residual w={width}")
    atol, rtol = NORM_TOL[out_dtype]
    assert_close(normed, ref_layernorm(expected_res, weight, bias), atol=atol, rtol=rtol,
                 what=f"normalized w={width} {out_dtype}")
    assert torch.equal(branch, b_before)
    # the residual may be updated in place (documented or not), but if it is, it must hold the new value
    if not torch.equal(residual, r_before):
        assert torch.equal(residual, new_res), "residual was modified but does not hold residual + branch"


@pytest.mark.parametrize("width", WIDTHS)
def test_branch_none_is_plain_layernorm(width, assert_close):
    residual, _, weight, bias = make(5, width)
    before = residual.clone()
    new_res, normed = add_layernorm(residual, None, weight, bias, eps=EPS, out_dtype=torch.float32)
    assert_close(new_res, before.double().cpu(), atol=0, rtol=0, what="new_residual with branch=None")
    assert_close(normed, ref_layernorm(before, weight, bias), atol=2e-5, rtol=2e-5, what="normalized, branch=None")


@pytest.mark.parametrize("width", (80, 1000))
def test_low_precision_branch(width, assert_close):
    """The branch may come from an fp16 matmul: it is added in fp32."""
    residual, branch, weight, bias = make(6, width, branch_dtype=torch.float16)
    new_res, normed = add_layernorm(residual, branch, weight, bias, eps=EPS, out_dtype=torch.float16)
    expected = residual.double().cpu() + branch.double().cpu()
    assert new_res.dtype == torch.float32
    assert_close(new_res, expected, atol=1e-6, rtol=1e-6, what="new_residual fp32 + fp16 branch")
    assert_close(normed, ref_layernorm(expected, weight, bias), atol=2e-3, rtol=1e-3, what="normalized fp16")


@pytest.mark.parametrize("width", (32, 80, 1024))
def test_row_mask_zeroes_rows(width, assert_close):
    residual, branch, weight, bias = make(9, width)
    row_mask = torch.tensor([True, False, True, True, False, False, True, False, True], device=DEVICE)
    new_res, normed = add_layernorm(residual, branch, weight, bias, eps=EPS, out_dtype=torch.float32,
                                    row_mask=row_mask)
    expected_res = (residual.double().cpu() + branch.double().cpu()) * row_mask.cpu()[:, None]
    assert_close(new_res, expected_res, atol=1e-6, rtol=1e-6, what="new_residual with row_mask")
    keep = row_mask.cpu()
    assert new_res.cpu()[~keep].abs().max().item() == 0.0, "masked rows of new_residual are not 0"
    assert_close(normed.cpu()[keep], ref_layernorm(expected_res[keep], weight, bias), atol=2e-5, rtol=2e-5,
                 what="normalized valid rows with row_mask")
    assert torch.isfinite(normed).all()
    assert normed.cpu()[~keep].abs().max().item() == 0.0, "masked rows of the normalized output are not 0"


@pytest.mark.parametrize("width", (80, 128))
def test_strided_rows(width, assert_close):
    """Row-strided views (a column slice of a wider tensor, a transposed [S, B, d] stream) are read by stride."""
    g = torch.Generator().manual_seed(width)
    wide = torch.randn(6, 2 * width, generator=g).to(DEVICE)
    residual = wide[:, :width]
    branch = wide[:, width:]
    weight, bias = (torch.rand(width, generator=g) + 0.5).to(DEVICE), torch.randn(width, generator=g).to(DEVICE)
    new_res, normed = add_layernorm(residual, branch, weight, bias, eps=EPS, out_dtype=torch.float32)
    exp = residual.double().cpu() + branch.double().cpu()
    assert_close(new_res, exp, atol=1e-6, rtol=1e-6, what="strided new_residual")
    assert_close(normed, ref_layernorm(exp, weight, bias), atol=2e-5, rtol=2e-5, what="strided normalized")
    stream = torch.randn(5, 3, width, generator=g).to(DEVICE).transpose(0, 1)  # [3, 5, width], not contiguous
    _, n2 = add_layernorm(stream, None, weight, bias, eps=EPS, out_dtype=torch.float32)
    assert n2.shape == (3, 5, width)
    assert_close(n2, ref_layernorm(stream, weight, bias), atol=2e-5, rtol=2e-5, what="transposed stream")


def test_three_dimensional_input(assert_close):
    """[B, S, d] activations, as the model holds them."""
    g = torch.Generator().manual_seed(3)
    residual = torch.randn(2, 7, 80, generator=g).to(DEVICE)
    branch = torch.randn(2, 7, 80, generator=g).to(DEVICE)
    weight, bias = torch.rand(80, generator=g).to(DEVICE) + 0.5, torch.randn(80, generator=g).to(DEVICE)
    new_res, normed = add_layernorm(residual, branch, weight, bias, eps=EPS, out_dtype=torch.float32)
    assert new_res.shape == (2, 7, 80) and normed.shape == (2, 7, 80)
    exp = residual.double().cpu() + branch.double().cpu()
    assert_close(normed, ref_layernorm(exp, weight, bias), atol=2e-5, rtol=2e-5, what="3-D add_layernorm")


def test_constant_row_and_large_offset(assert_close):
    """A constant row has variance 0 (output = bias); a row with a large mean must not lose its variance
    (a one-pass E[x^2]-E[x]^2 in fp32 would)."""
    width = 128
    g = torch.Generator().manual_seed(11)
    residual = torch.stack([torch.full((width,), 3.0), torch.randn(width, generator=g) + 1000.0]).to(DEVICE)
    weight, bias = (torch.rand(width, generator=g) + 0.5).to(DEVICE), torch.randn(width, generator=g).to(DEVICE)
    _, normed = add_layernorm(residual, None, weight, bias, eps=EPS, out_dtype=torch.float32)
    assert_close(normed, ref_layernorm(residual, weight, bias), atol=1e-3, rtol=1e-3,
                 what="constant row / mean 1000 row")


@pytest.mark.parametrize("width,out_dtype", [(32, None), (80, torch.float16), (1000, torch.float32),
                                             (1024, torch.bfloat16), (128, None)],
                         ids=lambda v: str(v).replace("torch.", ""))
def test_layer_norm(width, out_dtype, assert_close):
    x, _, weight, bias = make(5, width)
    y = layer_norm(x, weight, bias, EPS, out_dtype=out_dtype)
    expected_dtype = x.dtype if out_dtype is None else out_dtype
    assert y.dtype == expected_dtype and y.shape == x.shape
    atol, rtol = NORM_TOL[expected_dtype]
    assert_close(y, ref_layernorm(x, weight, bias), atol=atol, rtol=rtol, what=f"layer_norm w={width}")


def test_layer_norm_matches_torch_eps():
    x, _, weight, bias = make(4, 80)
    for eps in (1e-5, 1e-2):
        y = layer_norm(x, weight, bias, eps).cpu()
        t = torch.nn.functional.layer_norm(x.cpu(), (80,), weight.cpu(), bias.cpu(), eps)
        torch.testing.assert_close(y, t, atol=2e-5, rtol=2e-5)


def test_bad_inputs_raise():
    residual, branch, weight, bias = make(3, 32)
    cases = [
        ("branch", lambda: add_layernorm(residual, branch[:, :16], weight, bias, eps=EPS)),
        ("weight", lambda: add_layernorm(residual, branch, weight[:16], bias, eps=EPS)),
        ("bias", lambda: add_layernorm(residual, branch, weight, bias[:16], eps=EPS)),
        ("row_mask", lambda: add_layernorm(residual, branch, weight, bias, row_mask=torch.ones(5, dtype=torch.bool,
                                                                                            device=DEVICE), eps=EPS)),
    ]
    for name, call in cases:
        with pytest.raises((ValueError, TypeError)) as ei:
            call()
        assert name in str(ei.value), f"error does not name {name!r}: {ei.value}"
