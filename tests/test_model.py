"""The whole model on the CPU: UserOptimizedTransformer (every CPU-capable route) against BaselineTransformer,
BaselineTransformer against an fp64 model written here, and the model's contract (state dict, errors, routes,
inputs, comparator, drop-in use).

Small configs only (B<=2, S<=33, d<=64, 1-2 layers): the Triton route runs under TRITON_INTERPRET=1 here.
"""

import dataclasses
import math
import re
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from shapewise import model
from shapewise.model import (TOLERANCES, BaselineTransformer, TransformerConfig, UserOptimizedTransformer, compare_outputs,
                   generate_random_case)
from shapewise.model import routing

OFFICIAL = TOLERANCES["official"]
MASK_KINDS = ("none", "all_true", "prefix", "left", "holes", "one_empty")

# small configs: (B, S, d, H, ffn, L)
CFG_MAIN = (2, 33, 64, 4, 96, 2)  # head_dim 16, odd S
CFG_SEQ1 = (2, 1, 32, 2, 64, 1)  # S = 1
CFG_SEQ7 = (2, 7, 48, 3, 80, 1)  # head_dim 16, three heads
CFG_HD8 = (1, 33, 32, 4, 64, 1)  # head_dim 8


def cfg_of(t, causal=True):
    B, S, d, H, f, L = t
    return TransformerConfig(batch_size=B, seq_len=S, d_model=d, num_heads=H, ffn_dim=f, num_layers=L,
                             causal=causal)


def cpu_routes():
    """Names of the routes model.routing says serve a CPU tensor (read from the module, not hard-coded)."""
    names = []
    shape = routing.Shape(batch_size=2, seq_len=8, d_model=32, num_heads=2, ffn_dim=64, num_layers=1, causal=True)
    for name in routing.ROUTES:
        try:
            r = routing.select_route(shape, torch.float32, torch.device("cpu"), "general", forced=name)
        except routing.RouteUnavailable:
            continue
        assert r.name == name
        names.append(name)
    return names


CPU_ROUTES = cpu_routes()


def make_mask(kind, B, S, device="cpu"):
    pos = torch.arange(S)
    if kind == "none":
        return None
    if kind == "all_true":
        m = torch.ones(B, S, dtype=torch.bool)
    elif kind == "prefix":
        lengths = torch.tensor([max(1, (S * 2) // 3)] + [S] * (B - 1))[:B]
        m = pos[None, :] < lengths[:, None]
    elif kind == "left":
        lengths = torch.tensor([max(1, S // 2)] + [S - 1 if S > 1 else 1] * (B - 1))[:B]
        m = pos[None, :] >= (S - lengths)[:, None]
    elif kind == "holes":
        g = torch.Generator().manual_seed(S)
        m = torch.rand(B, S, generator=g) < 0.6
        m[:, S // 2] = True
        if S > 2:
            m[0, 0] = False
    elif kind == "one_empty":
        m = torch.ones(B, S, dtype=torch.bool)
        m[0] = False
        if B > 1 and S > 2:
            m[1, S - 2:] = False
    else:
        raise AssertionError(kind)
    return m.to(device)


def make_inputs(cfg, mask_kind, dtype=torch.float32, seed=0):
    x, _ = generate_random_case(cfg, "cpu", torch.float32, seed)
    mask = make_mask(mask_kind, cfg.batch_size, cfg.seq_len)
    if mask is not None:
        x = x.masked_fill(~mask[..., None], 0.0)
    return x.to(dtype), mask


def build_pair(cfg, route="auto", seed=0, **kw):
    torch.manual_seed(seed)
    ref = BaselineTransformer(cfg).eval()
    # non-trivial LayerNorm parameters so that a kernel ignoring weight/bias cannot pass
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    opt = UserOptimizedTransformer(cfg, route=route, **kw).eval()
    opt.load_state_dict(ref.state_dict(), strict=True)
    return ref, opt


# ----------------------------------------------------------------------------------------------------------
# fp64 reference written here (independent of model/)
# ----------------------------------------------------------------------------------------------------------
def fp64_forward(state, cfg, x, mask=None):
    p = {k: v.detach().to(torch.float64) for k, v in state.items()}
    x = x.detach().to(torch.float64)
    B, S, d = x.shape
    H = cfg.num_heads
    D = d // H
    keep = None if mask is None else mask[..., None].to(torch.float64)

    def ln(t, n):
        return F.layer_norm(t, (d,), p[n + ".weight"], p[n + ".bias"], 1e-5)

    def lin(t, n):
        return t @ p[n + ".weight"].T + p[n + ".bias"]

    for i in range(cfg.num_layers):
        pre = f"layers.{i}."
        h = ln(x, pre + "norm1")
        q, k, v = (lin(h, pre + f"attention.{n}_proj").view(B, S, H, D).transpose(1, 2) for n in "qkv")
        s = q @ k.transpose(-1, -2) / math.sqrt(D)
        allowed = torch.ones(B, 1, S, S, dtype=torch.bool)
        if cfg.causal:
            allowed &= torch.ones(S, S, dtype=torch.bool).tril()
        if mask is not None:
            allowed &= mask[:, None, None, :]
        s = s.masked_fill(~allowed, -math.inf)
        probs = torch.softmax(s, -1)
        # the reference's softmax of an all -inf row is NaN: keep NaN rows only where some key exists
        probs = torch.where(allowed.any(-1, keepdim=True), probs, torch.full_like(probs, math.nan))
        a = (probs @ v).transpose(1, 2).reshape(B, S, d)
        a = lin(a, pre + "attention.out_proj")
        if keep is not None:
            a = torch.where(keep.bool(), a, torch.zeros_like(a))
        x = x + a
        x = x + lin(F.gelu(lin(ln(x, pre + "norm2"), pre + "ffn_in")), pre + "ffn_out")
        if keep is not None:
            x = torch.where(keep.bool(), x, torch.zeros_like(x))
    x = ln(x, "final_norm")
    if keep is not None:
        x = torch.where(keep.bool(), x, torch.zeros_like(x))
    return x


@pytest.mark.parametrize("mask_kind", MASK_KINDS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_baseline_matches_fp64(mask_kind, causal, assert_close):
    cfg = cfg_of(CFG_MAIN, causal)
    ref, _ = build_pair(cfg)
    x, mask = make_inputs(cfg, mask_kind)
    with torch.no_grad():
        y = ref(x, mask)
        e = fp64_forward(ref.state_dict(), cfg, x, mask)
    assert_close(y, e, atol=1e-4, rtol=1e-4, what=f"baseline vs fp64 ({mask_kind}, causal={causal})")


# ----------------------------------------------------------------------------------------------------------
# optimized vs baseline, every CPU-capable route
# ----------------------------------------------------------------------------------------------------------
def check_official(ref_out, opt_out, what):
    cmp = compare_outputs(ref_out, opt_out, rtol=OFFICIAL["rtol"], atol=OFFICIAL["atol"])
    assert cmp.failed_elements == 0, (f"{what}: {cmp.failed_elements}/{cmp.total_elements} failed, "
                                      f"max_abs={cmp.max_abs_error:.3e} worst={cmp.worst_index}")
    return cmp


def test_some_cpu_route_exists():
    assert CPU_ROUTES, f"no route in {routing.ROUTES} serves a CPU tensor"
    assert "reference" in CPU_ROUTES or "triton" in CPU_ROUTES


@pytest.mark.parametrize("route", CPU_ROUTES)
@pytest.mark.parametrize("mask_kind", MASK_KINDS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_optimized_matches_baseline(route, mask_kind, causal):
    cfg = cfg_of(CFG_MAIN, causal)
    ref, opt = build_pair(cfg, route)
    x, mask = make_inputs(cfg, mask_kind)
    with torch.no_grad():
        r = ref(x, mask)
        y = opt(x, mask)
    assert y.shape == r.shape and y.dtype == r.dtype
    assert opt.last_route.name == route
    check_official(r, y, f"route={route} mask={mask_kind} causal={causal}")
    if mask is not None and (~mask).any():
        assert y[~mask].abs().max().item() == 0.0, "invalid rows are not exactly zero"


@pytest.mark.parametrize("route", CPU_ROUTES)
@pytest.mark.parametrize("shape", [CFG_SEQ1, CFG_SEQ7, CFG_HD8], ids=["S1", "S7-H3", "hd8"])
@pytest.mark.parametrize("mask_kind", ["none", "prefix", "holes"])
def test_optimized_odd_shapes(route, shape, mask_kind):
    cfg = cfg_of(shape, causal=True)
    ref, opt = build_pair(cfg, route)
    x, mask = make_inputs(cfg, mask_kind)
    with torch.no_grad():
        check_official(ref(x, mask), opt(x, mask), f"route={route} shape={shape} mask={mask_kind}")


@pytest.mark.parametrize("route", CPU_ROUTES)
def test_auto_padding_from_generate_random_case(route):
    cfg = cfg_of(CFG_MAIN)
    ref, opt = build_pair(cfg, route)
    x, mask = generate_random_case(cfg, "cpu", torch.float32, seed=7, padding_ratio=0.5)
    assert mask is not None
    with torch.no_grad():
        check_official(ref(x, mask), opt(x, mask), f"route={route} generated padding")


@pytest.mark.parametrize("route", CPU_ROUTES)
def test_non_contiguous_mask(route):
    """A [B, S] mask that is a transposed view (strides (1, B)) is a valid user input."""
    cfg = cfg_of(CFG_MAIN)
    ref, opt = build_pair(cfg, route)
    x, mask = make_inputs(cfg, "holes")
    tmask = mask.t().contiguous().t()
    assert not tmask.is_contiguous() and torch.equal(tmask, mask)
    with torch.no_grad():
        check_official(ref(x, mask), opt(x, tmask), f"route={route} transposed mask")


@pytest.mark.parametrize("route", CPU_ROUTES)
def test_non_contiguous_input(route):
    cfg = cfg_of(CFG_SEQ7)
    ref, opt = build_pair(cfg, route)
    big = torch.randn(cfg.seq_len, cfg.batch_size, cfg.d_model)
    x = big.transpose(0, 1)  # [B, S, d] view, not contiguous
    with torch.no_grad():
        check_official(ref(x), opt(x), f"route={route} non-contiguous x")


# low-precision inputs: (atol, rtol) of the optimized output against the fp32 reference on the same (rounded)
# weights and inputs. The fp16/bf16 reference itself is off by up to ~3e-3 (fp16) / ~2.5e-2 (bf16) here.
LOWP_TOL = {torch.float16: (1e-2, 2e-2), torch.bfloat16: (6e-2, 5e-2)}


@pytest.mark.parametrize("route", CPU_ROUTES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("shape", [CFG_SEQ7, CFG_MAIN], ids=["S7", "S33"])
def test_low_precision_inputs(route, dtype, shape, assert_close):
    """fp16/bf16 model and inputs. The CPU reference runs in those dtypes too (checked: nn.Linear, LayerNorm
    and matmul accept them on the CPU), but it is itself inexact, so both are measured against the fp32
    reference with the same rounded weights: the optimized output must be within the dtype's tolerance and
    its mean error no worse than twice the low-precision reference's own."""
    cfg = cfg_of(shape)
    ref, opt = build_pair(cfg, route)
    ref, opt = ref.to(dtype), opt.to(dtype)
    ref32 = BaselineTransformer(cfg).eval()
    ref32.load_state_dict({k: v.float() for k, v in ref.state_dict().items()}, strict=True)
    x, mask = make_inputs(cfg, "prefix", dtype)
    with torch.no_grad():
        truth = ref32(x.float(), mask)
        r = ref(x, mask)
        y = opt(x, mask)
    assert y.dtype == dtype and y.shape == x.shape
    atol, rtol = LOWP_TOL[dtype]
    assert_close(y, truth, atol=atol, rtol=rtol, what=f"route={route} {dtype} vs fp32 reference")
    err_opt = (y.float() - truth).abs().mean().item()
    err_ref = (r.float() - truth).abs().mean().item()
    assert err_opt <= 2 * err_ref + 1e-5, f"mean error {err_opt:.2e} vs the {dtype} reference's {err_ref:.2e}"


# ----------------------------------------------------------------------------------------------------------
# parameters and state
# ----------------------------------------------------------------------------------------------------------
def expected_param_names(L):
    names = set()
    for i in range(L):
        for n in ("norm1", "norm2", "attention.q_proj", "attention.k_proj", "attention.v_proj", "attention.out_proj",
                  "ffn_in", "ffn_out"):
            names |= {f"layers.{i}.{n}.weight", f"layers.{i}.{n}.bias"}
    return names | {"final_norm.weight", "final_norm.bias"}


def test_state_dict_keys_and_strict_load():
    cfg = cfg_of(CFG_MAIN)
    ref = BaselineTransformer(cfg)
    opt = UserOptimizedTransformer(cfg)
    assert set(ref.state_dict().keys()) == expected_param_names(cfg.num_layers)
    assert list(opt.state_dict().keys()) == list(ref.state_dict().keys())
    for k, v in ref.state_dict().items():
        assert opt.state_dict()[k].shape == v.shape, k
    opt.load_state_dict(ref.state_dict(), strict=True)
    ref.load_state_dict(opt.state_dict(), strict=True)
    assert {n for n, _ in opt.named_parameters()} == expected_param_names(cfg.num_layers)


@pytest.mark.parametrize("route", CPU_ROUTES)
def test_in_place_weight_edit_after_first_forward(route):
    """Caches (packed qkv weights etc.) must notice an in-place edit of a parameter."""
    cfg = cfg_of(CFG_MAIN)
    ref, opt = build_pair(cfg, route)
    x, mask = make_inputs(cfg, "prefix")
    with torch.no_grad():
        first = opt(x, mask).clone()
        for name in ("layers.0.attention.k_proj.weight", "layers.1.norm2.weight", "layers.0.ffn_in.bias"):
            dict(opt.named_parameters())[name].mul_(1.5).add_(0.05)
        fresh = BaselineTransformer(cfg).eval()
        fresh.load_state_dict(opt.state_dict(), strict=True)
        second = opt(x, mask)
        check_official(fresh(x, mask), second, f"route={route} after in-place edit")
    assert not torch.allclose(first, second), "output did not change after the weights changed"


@pytest.mark.parametrize("route", CPU_ROUTES)
def test_load_state_dict_after_first_forward(route):
    cfg = cfg_of(CFG_SEQ7)
    ref, opt = build_pair(cfg, route)
    x, _ = make_inputs(cfg, "none")
    with torch.no_grad():
        opt(x)
        other = BaselineTransformer(cfg).eval()
        opt.load_state_dict(other.state_dict(), strict=True)
        check_official(other(x), opt(x), f"route={route} after load_state_dict")


@pytest.mark.parametrize("route", CPU_ROUTES)
def test_load_state_dict_assign_after_first_forward(route):
    """`load_state_dict(..., assign=True)` swaps in new Parameter objects (whose version counters may equal
    the old ones): the next forward must use the new weights."""
    cfg = cfg_of(CFG_SEQ7)
    ref, opt = build_pair(cfg, route)
    x, _ = make_inputs(cfg, "none")
    with torch.no_grad():
        opt(x)
        torch.manual_seed(123)
        other = BaselineTransformer(cfg).eval()
        opt.load_state_dict({k: v.clone() for k, v in other.state_dict().items()}, strict=True, assign=True)
        check_official(other(x), opt(x), f"route={route} after load_state_dict(assign=True)")


@pytest.mark.parametrize("route", CPU_ROUTES)
def test_parameter_data_swap_after_first_forward(route):
    """`param.data = new_tensor` (a common way to set weights) after the first forward."""
    cfg = cfg_of(CFG_SEQ7)
    ref, opt = build_pair(cfg, route)
    x, _ = make_inputs(cfg, "none")
    with torch.no_grad():
        opt(x)
        torch.manual_seed(321)
        for name, p in opt.named_parameters():
            if name.endswith("v_proj.weight") or name.endswith("ffn_out.weight"):
                p.data = torch.randn_like(p) * 0.2
        fresh = BaselineTransformer(cfg).eval()
        fresh.load_state_dict(opt.state_dict(), strict=True)
        check_official(fresh(x), opt(x), f"route={route} after param.data swap")


@pytest.mark.parametrize("route", CPU_ROUTES)
def test_outputs_do_not_alias(route):
    cfg = cfg_of(CFG_SEQ7)
    _, opt = build_pair(cfg, route)
    x1, _ = make_inputs(cfg, "none", seed=1)
    x2, _ = make_inputs(cfg, "none", seed=2)
    with torch.no_grad():
        y1 = opt(x1)
        keep = y1.clone()
        x1_before = x1.clone()
        y2 = opt(x2)
    assert torch.equal(y1, keep), "output of call 1 changed by call 2"
    assert y1.data_ptr() != y2.data_ptr()
    assert torch.equal(x1, x1_before), "forward modified its input"


@pytest.mark.parametrize("route", CPU_ROUTES)
def test_global_flags_untouched(route):
    cfg = cfg_of(CFG_SEQ7)
    _, opt = build_pair(cfg, route)
    x, _ = make_inputs(cfg, "none")
    flags = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
             torch.get_float32_matmul_precision(), torch.is_grad_enabled())
    opt(x)
    assert flags == (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
                     torch.get_float32_matmul_precision(), torch.is_grad_enabled())


# ----------------------------------------------------------------------------------------------------------
# routes
# ----------------------------------------------------------------------------------------------------------
GPU_ONLY = [n for n in routing.ROUTES if n not in CPU_ROUTES]


@pytest.mark.parametrize("name", GPU_ONLY or ["<none>"])
def test_forced_gpu_route_on_cpu_raises(name):
    if name == "<none>":
        pytest.skip(f"every route in {routing.ROUTES} serves the CPU")
    cfg = cfg_of(CFG_SEQ7)
    _, opt = build_pair(cfg, name)
    x, _ = make_inputs(cfg, "none")
    with pytest.raises(routing.RouteUnavailable) as ei:
        opt(x)
    assert isinstance(ei.value, RuntimeError)
    assert name in str(ei.value), f"RouteUnavailable does not name {name!r}: {ei.value}"


def test_unknown_route_raises_value_error():
    cfg = cfg_of(CFG_SEQ7)
    with pytest.raises(ValueError) as ei:
        m = UserOptimizedTransformer(cfg, route="warp-speed")
        m(make_inputs(cfg, "none")[0])
    assert "warp-speed" in str(ei.value)


@pytest.mark.parametrize("route", CPU_ROUTES)
def test_env_var_forces_route(route, monkeypatch):
    monkeypatch.setenv("SHAPEWISE_ROUTE", route)
    cfg = cfg_of(CFG_SEQ7)
    ref, opt = build_pair(cfg, "auto")
    x, _ = make_inputs(cfg, "none")
    with torch.no_grad():
        y = opt(x)
    assert opt.last_route.name == route
    check_official(ref(x), y, f"SHAPEWISE_ROUTE={route}")


def test_env_var_unknown_route(monkeypatch):
    monkeypatch.setenv("SHAPEWISE_ROUTE", "warp-speed")
    cfg = cfg_of(CFG_SEQ7)
    with pytest.raises(ValueError) as ei:
        m = UserOptimizedTransformer(cfg)
        m(make_inputs(cfg, "none")[0])
    assert "warp-speed" in str(ei.value)


@pytest.mark.parametrize("name", GPU_ONLY or ["<none>"])
def test_env_var_gpu_route_on_cpu_raises(name, monkeypatch):
    if name == "<none>":
        pytest.skip(f"every route in {routing.ROUTES} serves the CPU")
    monkeypatch.setenv("SHAPEWISE_ROUTE", name)
    cfg = cfg_of(CFG_SEQ7)
    _, opt = build_pair(cfg, "auto")
    with pytest.raises(routing.RouteUnavailable) as ei:
        opt(make_inputs(cfg, "none")[0])
    assert name in str(ei.value)


def test_last_route_names_the_route():
    cfg = cfg_of(CFG_SEQ7)
    _, opt = build_pair(cfg, "auto")
    with torch.no_grad():
        opt(make_inputs(cfg, "none")[0])
    r = opt.last_route
    assert isinstance(r, routing.Route)
    assert r.name in str(r) and r.name in routing.ROUTES and r.name in CPU_ROUTES
    assert r.precision in routing.PRECISIONS and r.reason
    d = r.as_dict()
    assert d["name"] == r.name and "precision" in d and "reason" in d
    import json

    json.dumps(d)


def _optimization_names():
    from shapewise.model import optimized

    return list(getattr(optimized, "OPTIMIZATIONS", ()))


KERNEL_ROUTES = [r for r in CPU_ROUTES if r not in ("reference", "sdpa")]  # the routes the switches act on


@pytest.mark.parametrize("route", KERNEL_ROUTES or ["<none>"])
@pytest.mark.parametrize("name", _optimization_names() or ["<none>"])
def test_each_ablation_switch_stays_correct(name, route):
    """Each optimization turned off alone still gives the reference's output, on each kernel route."""
    if name == "<none>" or route == "<none>":
        pytest.skip("model.optimized.OPTIMIZATIONS is empty or no kernel route serves the CPU")
    cfg = cfg_of(CFG_MAIN)
    ref, opt = build_pair(cfg, route, disable=(name,))
    x, mask = make_inputs(cfg, "holes")
    with torch.no_grad():
        try:
            y = opt(x, mask)
        except routing.RouteUnavailable as e:
            # a forced route may refuse what a switch takes away (e.g. one kernel per layer needs fp16/bf16
            # operands): the refusal must say which route
            assert route in str(e), f"RouteUnavailable does not name {route!r}: {e}"
            return
        check_official(ref(x, mask), y, f"route={route} disable={name}")
    assert opt.last_route.name == route


@pytest.mark.parametrize("route", KERNEL_ROUTES or ["<none>"])
def test_switches_a_route_does_not_use_change_nothing(route):
    """model.optimized.switches_used: turning off a switch it leaves out gives bit-identical outputs on the
    same route (which is why the ablation job records those as not applicable instead of timing them)."""
    from shapewise.model.optimized import OPTIMIZATIONS, switches_used

    if route == "<none>":
        pytest.skip("no kernel route serves the CPU")
    cfg = cfg_of(CFG_SEQ7)
    ref, opt = build_pair(cfg, route)
    x, mask = make_inputs(cfg, "holes")
    with torch.no_grad():
        y = opt(x, mask)
    used = switches_used(opt.last_route, x.dtype, x.device.type)
    assert "reduced_precision" in used and set(used) < set(OPTIMIZATIONS)
    for name in OPTIMIZATIONS:
        if name in used:
            continue
        _, other = build_pair(cfg, route, disable=(name,))
        with torch.no_grad():
            assert torch.equal(other(x, mask), y), f"route {route}: switching off unused {name} changed the output"
        assert other.last_route.name == opt.last_route.name


def test_switches_used_per_route():
    from shapewise.model.optimized import switches_used
    from shapewise.model.routing import Route

    f32 = torch.float32
    assert switches_used(Route("sdpa", "fp32", "r"), f32, "cuda") == ()
    assert switches_used(Route("fused", "fp16", "r"), f32, "cuda") == ("fused_layer", "cuda_graph", "reduced_precision")
    assert switches_used(Route("fused", "fp16", "r"), torch.float16, "cpu") == ("fused_layer",)
    assert switches_used(Route("graph", "fp16", "r"), f32, "cuda") == (
        "cuda_graph", "reduced_precision", "flash_attention", "fused_layernorm", "packed_qkv")
    assert switches_used(Route("triton", "fp16", "r", attention="sdpa"), f32, "cuda") == (
        "reduced_precision", "fused_layernorm", "packed_qkv")


def test_env_disable_unknown_name(monkeypatch):
    monkeypatch.setenv("SHAPEWISE_DISABLE", "no-such-optimization")
    cfg = cfg_of(CFG_SEQ7)
    with pytest.raises(ValueError) as ei:
        m = UserOptimizedTransformer(cfg)
        m(make_inputs(cfg, "none")[0])
    assert "no-such-optimization" in str(ei.value)


# ----------------------------------------------------------------------------------------------------------
# bad inputs and configs
# ----------------------------------------------------------------------------------------------------------
def _bad_input_cases(cfg):
    B, S, d = cfg.batch_size, cfg.seq_len, cfg.d_model
    x = torch.randn(B, S, d)
    ok_mask = torch.ones(B, S, dtype=torch.bool)
    return {
        "x-rank2": ("x", (x[0], None)),
        "x-rank4": ("x", (x[None], None)),
        "x-width": ("x|d_model", (torch.randn(B, S, d + 1), None)),
        "x-int": ("x", (x.to(torch.int64), None)),
        "x-list": ("x", (x.tolist(), None)),
        "mask-shape": ("valid_token_mask", (x, ok_mask[:, :-1])),
        "mask-rank": ("valid_token_mask", (x, ok_mask[..., None])),
        "mask-dtype": ("valid_token_mask", (x, ok_mask.float())),
        "mask-device": ("valid_token_mask|device", (x, ok_mask.to("meta"))),
    }


@pytest.mark.parametrize("which", ["baseline", "optimized"])
@pytest.mark.parametrize("case", sorted(_bad_input_cases(cfg_of(CFG_SEQ7))))
def test_bad_inputs_raise_naming_the_culprit(which, case):
    cfg = cfg_of(CFG_SEQ7)
    name, (x, mask) = _bad_input_cases(cfg)[case]
    m = BaselineTransformer(cfg) if which == "baseline" else UserOptimizedTransformer(cfg)
    with pytest.raises((ValueError, TypeError)) as ei:
        m(x, mask)
    assert re.search(name, str(ei.value)), f"error does not name {name!r}: {ei.value}"


@pytest.mark.parametrize("field,value", [
    ("num_heads", 5),  # 64 % 5 != 0
    ("batch_size", 0), ("seq_len", -1), ("d_model", 0), ("num_heads", 0), ("ffn_dim", 0), ("num_layers", 0),
])
@pytest.mark.parametrize("which", ["config", "baseline", "optimized"])
def test_bad_config_raises_naming_the_field(field, value, which):
    fields = dict(zip(("batch_size", "seq_len", "d_model", "num_heads", "ffn_dim", "num_layers"), CFG_MAIN))
    fields[field] = value
    ns = SimpleNamespace(**fields, causal=True)
    with pytest.raises((ValueError, TypeError)) as ei:
        if which == "config":
            TransformerConfig(**vars(ns)).validate()
        elif which == "baseline":
            BaselineTransformer(ns)
        else:
            UserOptimizedTransformer(ns)
    assert field in str(ei.value), f"error does not name {field!r}: {ei.value}"


@pytest.mark.parametrize("route", CPU_ROUTES)
@pytest.mark.parametrize("mask_kind", ["none", "prefix", "holes"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_nan_propagates_like_reference(route, mask_kind, causal):
    """A NaN in one valid token of x: the reference's output is NaN exactly on the rows that attend to it
    (and finite elsewhere); the optimized model must give the same NaN pattern (no crash, no NaN hidden
    as a number, no NaN leaking into rows that cannot see the token)."""
    cfg = cfg_of(CFG_SEQ7, causal)
    ref, opt = build_pair(cfg, route)
    x, mask = make_inputs(cfg, mask_kind)
    if mask is not None:
        mask[0, 3] = True  # the poisoned token is valid
        mask[0, 5] = False
    x[0, 3, 5] = float("nan")
    with torch.no_grad():
        r = ref(x, mask)
        y = opt(x, mask)
    assert torch.isnan(r).any()
    assert torch.equal(torch.isnan(y), torch.isnan(r)), (
        f"NaN pattern differs: reference NaN rows {torch.isnan(r).any(-1).nonzero().tolist()}, "
        f"optimized {torch.isnan(y).any(-1).nonzero().tolist()}")
    fin = ~torch.isnan(r)
    torch.testing.assert_close(y[fin], r[fin], atol=OFFICIAL["atol"], rtol=OFFICIAL["rtol"])


# ----------------------------------------------------------------------------------------------------------
# generate_random_case and compare_outputs
# ----------------------------------------------------------------------------------------------------------
def test_generate_random_case_reproducible_and_padded():
    cfg = cfg_of((4, 33, 32, 2, 64, 1))
    a, ma = generate_random_case(cfg, "cpu", torch.float32, seed=5, padding_ratio=0.5)
    b, mb = generate_random_case(cfg, "cpu", torch.float32, seed=5, padding_ratio=0.5)
    c, _ = generate_random_case(cfg, "cpu", torch.float32, seed=6, padding_ratio=0.5)
    assert torch.equal(a, b) and torch.equal(ma, mb)
    assert not torch.equal(a, c)
    assert a.shape == (4, 33, 32) and ma.shape == (4, 33) and ma.dtype == torch.bool
    lengths = ma.sum(1)
    low = max(1, round(33 * 0.5))
    assert ((lengths >= low) & (lengths <= 33)).all()
    # prefix masks: valid positions are exactly [0, length)
    assert torch.equal(ma, torch.arange(33)[None, :] < lengths[:, None])
    assert a[~ma].abs().max().item() == 0.0, "padded rows are not zeroed"
    assert a[ma].abs().min().item() >= 0 and a[ma].std().item() > 0.5


def test_generate_random_case_no_padding_and_scale():
    cfg = cfg_of((2, 16, 32, 2, 64, 1))
    x, m = generate_random_case(cfg, "cpu", torch.float32, seed=3)
    assert m is None
    y, _ = generate_random_case(cfg, "cpu", torch.float32, seed=3, input_scale=4.0)
    torch.testing.assert_close(y, 4.0 * x)
    h, _ = generate_random_case(cfg, "cpu", torch.float16, seed=3)
    assert h.dtype == torch.float16
    torch.testing.assert_close(h.float(), x, atol=1e-3, rtol=1e-3)
    # independent of the global RNG
    torch.manual_seed(99)
    x2, _ = generate_random_case(cfg, "cpu", torch.float32, seed=3)
    assert torch.equal(x, x2)


def test_generate_random_case_generator_device():
    """generator_device="device" draws with a generator on the target device: on the CPU that is the CPU draw
    itself (padding included); an unknown value is refused by name."""
    cfg = cfg_of((3, 17, 16, 2, 32, 1))
    a, ma = generate_random_case(cfg, "cpu", torch.float32, seed=11, padding_ratio=0.4)
    b, mb = generate_random_case(cfg, "cpu", torch.float32, seed=11, padding_ratio=0.4, generator_device="device")
    assert torch.equal(a, b) and torch.equal(ma, mb)
    with pytest.raises(ValueError, match="generator_device"):
        generate_random_case(cfg, "cpu", torch.float32, seed=11, generator_device="gpu")


def test_generate_random_case_seed_determines_x_directly():
    """x = randn(B, S, d) * input_scale from a generator seeded with `seed` (contract)."""
    cfg = cfg_of((2, 5, 8, 2, 16, 1))
    x, _ = generate_random_case(cfg, "cpu", torch.float32, seed=1234)
    g = torch.Generator().manual_seed(1234)
    torch.testing.assert_close(x, torch.randn(2, 5, 8, generator=g), atol=0, rtol=0)


def test_compare_outputs_counts_and_worst_index():
    ref = torch.tensor([[1.0, 100.0, 0.0, 1.0], [1.0, 2.0, float("nan"), 5.0]])
    opt = ref.clone()
    opt[0, 0] = 1.0 + 0.0015  # |d| = 1.5e-3 <= atol 2e-3: passes on atol (rtol*|ref| = 0.02 also covers it)
    opt[0, 1] = 100.0 + 1.5  # |d| = 1.5 > atol, <= rtol*100 = 2: passes on rtol only
    opt[0, 2] = 0.0 + 0.0019  # ref 0: passes on atol only
    opt[0, 3] = 1.0 + 0.03  # |d| = 0.03 > 2e-3 and > 0.02: fails
    opt[1, 1] = float("inf")  # not finite: fails
    # [1, 2]: NaN in reference and in optimized: both must be finite -> fails
    opt[1, 2] = float("nan")
    opt[1, 3] = 5.0 + 0.2  # fails, the largest finite error
    c = compare_outputs(ref, opt, rtol=2e-2, atol=2e-3)
    assert c.total_elements == 8
    assert c.failed_elements == 4
    assert not c.passed
    # the worst failing element: a non-finite one (inf or NaN) ranks above any finite error
    assert tuple(c.worst_index) in {(1, 1), (1, 2)}
    assert math.isclose(c.max_abs_error, 1.5, rel_tol=1e-9)  # over the finite pairs
    d = c.as_dict()
    assert d["failed_elements"] == 4 and isinstance(d["worst_index"], list)


def test_compare_outputs_rule_boundaries():
    ref = torch.tensor([10.0, 10.0, 0.001, -3.0])
    opt = torch.tensor([10.19, 10.21, 0.0029, -3.0 + 0.061])
    c = compare_outputs(ref, opt, rtol=2e-2, atol=2e-3)
    # 10.19: 0.19 <= 0.2 passes; 10.21: 0.21 > 0.2 fails; 0.0029: 0.0019 <= atol passes; -2.939: 0.061 > 0.06 fails
    assert c.failed_elements == 2
    assert tuple(c.worst_index) == (1,), "worst failing element is the one with the largest error (0.21)"
    ok = compare_outputs(ref, ref.clone(), rtol=0.0, atol=0.0)
    assert ok.passed and ok.failed_elements == 0 and ok.max_abs_error == 0.0
    only_nan_opt = compare_outputs(ref, torch.tensor([10.0, float("nan"), 0.001, -3.0]), rtol=2e-2, atol=2e-3)
    assert only_nan_opt.failed_elements == 1 and tuple(only_nan_opt.worst_index) == (1,)
    with pytest.raises(ValueError):
        compare_outputs(ref, ref[:3], rtol=2e-2, atol=2e-3)


def test_tolerances_constants():
    assert TOLERANCES == {"official": {"atol": 2e-3, "rtol": 2e-2}, "strict": {"atol": 1e-3, "rtol": 1e-2}}


# ----------------------------------------------------------------------------------------------------------
# drop-in use with a foreign config object
# ----------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class ForeignConfig:
    batch_size: int = 2
    seq_len: int = 7
    d_model: int = 48
    num_heads: int = 3
    ffn_dim: int = 80
    num_layers: int = 1
    causal: bool = True
    vocab: int = 123  # extra fields are ignored


@pytest.mark.parametrize("cfg_obj", [ForeignConfig(), SimpleNamespace(**{**vars(ForeignConfig()), "causal": False})],
                         ids=["dataclass", "namespace"])
def test_drop_in_foreign_config(cfg_obj):
    torch.manual_seed(1)
    ref = BaselineTransformer(cfg_obj).to("cpu", torch.float32).eval()
    opt = UserOptimizedTransformer(cfg_obj).to("cpu", torch.float32).eval()
    opt.load_state_dict(ref.state_dict(), strict=True)
    x = torch.randn(2, 7, 48)
    mask = torch.tensor([[True] * 7, [True] * 4 + [False] * 3])
    with torch.inference_mode():
        r = ref(x, mask)
        y = opt(x, mask)
    check_official(r, y, "drop-in")
    assert isinstance(opt.config, TransformerConfig) or hasattr(opt.config, "d_model")


def test_model_package_exports():
    for name in ("TransformerConfig", "BaselineTransformer", "UserOptimizedTransformer", "generate_random_case",
                 "compare_outputs", "TOLERANCES"):
        assert hasattr(model, name), name


@pytest.mark.parametrize("route", ["triton", "fused"])
def test_refresh_weights_after_write_through_data(route):
    """`p.data.copy_(t)` bypasses the version counter (PyTorch does not count it): the cache cannot see it,
    `refresh_weights()` rebuilds it. The first check pins down that limitation, so a change to it is noticed."""
    cfg = cfg_of(CFG_SEQ7)
    ref, opt = build_pair(cfg, route)
    x, _ = make_inputs(cfg, "none")
    with torch.no_grad():
        opt(x)
        w = opt.layers[0].ffn_out.weight
        w.data.copy_(torch.randn_like(w))
        ref.load_state_dict(opt.state_dict(), strict=True)
        stale = compare_outputs(ref(x), opt(x), rtol=OFFICIAL["rtol"], atol=OFFICIAL["atol"])
        assert stale.failed_elements > 0
        opt.refresh_weights()
        check_official(ref(x), opt(x), f"route={route} after refresh_weights()")


def test_constructor_route_wins_over_env(monkeypatch):
    """SHAPEWISE_ROUTE applies to route="auto"; an explicit constructor route is not overridden."""
    monkeypatch.setenv("SHAPEWISE_ROUTE", "reference")
    cfg = cfg_of(CFG_SEQ7)
    assert UserOptimizedTransformer(cfg).route == "reference"
    assert UserOptimizedTransformer(cfg, route="sdpa").route == "sdpa"


@pytest.mark.parametrize("mask_kind", ["none", "holes"])
def test_fused_route_with_precomputed_keys_and_values(monkeypatch, mask_kind):
    """A policy entry with kv_precompute runs the fused route as _ln_kv_fwd + the layer kernel per layer: the
    whole model still matches the reference (official comparator), and the route says which ran."""
    from shapewise.model import routing

    launch = [{**e, "kv_precompute": True} for e in routing.POLICY["fused"]["launch"]]
    monkeypatch.setitem(routing.POLICY, "fused", {**routing.POLICY["fused"], "launch": launch})
    cfg = cfg_of(CFG_SEQ7)
    ref, opt = build_pair(cfg, "fused")
    x, mask = make_inputs(cfg, mask_kind)
    with torch.no_grad():
        out = opt(x, mask)
        assert opt.last_route.kv_precompute, str(opt.last_route)
        check_official(ref(x, mask), out, f"fused kv_precompute mask={mask_kind}")
