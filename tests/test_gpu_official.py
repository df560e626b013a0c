"""The official shape rows on a CUDA GPU (the H200): `pytest -m gpu -s tests/test_gpu_official.py`.

Every official row, float32, causal, 5 trials (seeds 1234 + t), route "auto" and route "triton", against the
reference in fp32 with TF32 off, official comparator, zero failed elements. Row 14 (B=32, S=100000) is too big
for the plain reference: its output is checked on sampled batch elements against
`shapewise.model.chunked.chunked_reference_forward` on `x[b:b+1]`.

The strict comparator has its own parametrized test, so its result is visible row by row.
Each case prints one line: row, route, trial, failed/total, max abs error, the route taken.
"""

import gc
import os

import pytest
import torch

from shapewise.inputs.manifest import official_rows

pytestmark = pytest.mark.gpu

# row number: (batch_size, seq_len, d_model, num_heads, ffn_dim, num_layers), from shapes/official.yaml; all causal.
OFFICIAL_ROWS = {n: tuple(r[k] for k in ("batch_size", "seq_len", "d_model", "num_heads", "ffn_dim", "num_layers"))
                 for n, r in official_rows().items()}
CHUNKED_ROWS = {14}
TRIALS = int(os.environ.get("SHAPEWISE_GPU_TRIALS", "5"))  # 5 is the official count; lower only for a smoke run
SEED0 = 1234


def _config(row):
    from shapewise.model import TransformerConfig

    B, S, d, H, f, L = OFFICIAL_ROWS[row]
    return TransformerConfig(batch_size=B, seq_len=S, d_model=d, num_heads=H, ffn_dim=f, num_layers=L, causal=True)


@pytest.fixture
def no_tf32():
    """Reference numerics: fp32 matmuls without TF32. Restored afterwards."""
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _free():
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def _sampled_elements(B, trial):
    return sorted({trial % B, (7 * trial + B // 2) % B})


@torch.no_grad()
def _run_trial(row, route, trial, tolerance):
    """Builds both models from the trial's seed, runs them, returns a list of (label, Comparison, route name)."""
    from shapewise.model import (TOLERANCES, BaselineTransformer, UserOptimizedTransformer, compare_outputs,
                       generate_random_case)
    from shapewise.model.chunked import chunked_reference_forward

    cfg = _config(row)
    seed = SEED0 + trial
    dev = torch.device("cuda")
    torch.manual_seed(seed)
    ref = BaselineTransformer(cfg).to(dev, torch.float32).eval()
    opt = UserOptimizedTransformer(cfg, route=route).to(dev, torch.float32).eval()
    opt.load_state_dict(ref.state_dict(), strict=True)
    x, mask = generate_random_case(cfg, dev, torch.float32, seed)
    assert mask is None  # official rows: no padding

    # the optimized model first, so that a reference failure cannot mask its result
    tf32_before = torch.backends.cuda.matmul.allow_tf32
    y = opt(x)
    torch.cuda.synchronize()
    assert torch.backends.cuda.matmul.allow_tf32 == tf32_before, "optimized forward changed the global TF32 flag"
    taken = opt.last_route
    route_taken = f"{taken.name}/{taken.precision}"
    if route != "auto":
        assert taken.name == route, f"forced route {route!r} but last_route is {taken}"
    assert y.shape == x.shape and y.dtype == torch.float32

    tol = TOLERANCES[tolerance]
    results = []
    if row in CHUNKED_ROWS:
        for b in _sampled_elements(cfg.batch_size, trial):
            r = chunked_reference_forward(ref, x[b:b + 1], None, query_block=1024, compute_dtype=torch.float32)
            results.append((f"b={b}", compare_outputs(r, y[b:b + 1], rtol=tol["rtol"], atol=tol["atol"])))
            del r
    else:
        r = ref(x)
        results.append(("all", compare_outputs(r, y, rtol=tol["rtol"], atol=tol["atol"])))
        del r
    del x, y, ref, opt
    _free()
    return results, route_taken


def _check(row, route, tolerance):
    failures = []
    for trial in range(TRIALS):
        results, route_taken = _run_trial(row, route, trial, tolerance)
        for label, cmp in results:
            print(f"[{tolerance:8s}] row={row:>2} route={route:<6} took={route_taken:<12} trial={trial} {label:<6} "
                  f"failed={cmp.failed_elements}/{cmp.total_elements} max_abs={cmp.max_abs_error:.3e} "
                  f"max_rel={cmp.max_rel_error:.3e} worst={tuple(cmp.worst_index)}", flush=True)
            if cmp.failed_elements:
                failures.append(f"trial {trial} {label}: {cmp.failed_elements}/{cmp.total_elements} failed, "
                                f"max_abs={cmp.max_abs_error:.3e} at {tuple(cmp.worst_index)}")
    assert not failures, f"row {row} route {route} ({tolerance}): " + "; ".join(failures)


@pytest.mark.parametrize("route", ["auto", "triton"])
@pytest.mark.parametrize("row", sorted(OFFICIAL_ROWS), ids=lambda r: f"row{r}")
def test_official_row(row, route, no_tf32):
    _check(row, route, "official")


@pytest.mark.parametrize("row", sorted(OFFICIAL_ROWS), ids=lambda r: f"row{r}")
def test_strict_row(row, no_tf32):
    """The strict comparator (atol 1e-3, rtol 1e-2) on route auto: recorded per row, asserted like official."""
    _check(row, "auto", "strict")


# ----------------------------------------------------------------------------------------------------------
# Beyond the official rows, on the GPU: every route with padding masks, and the graph route's state handling
# ----------------------------------------------------------------------------------------------------------
def _masks(kind, B, S, dev):
    g = torch.Generator().manual_seed(S)
    if kind == "holes":
        m = torch.rand(B, S, generator=g) < 0.7
        m[:, 0] = False
        m[:, S // 2] = True
    elif kind == "left":
        lengths = torch.randint(1, S + 1, (B,), generator=g)
        m = torch.arange(S)[None, :] >= (S - lengths)[:, None]
    elif kind == "one_empty":
        m = torch.ones(B, S, dtype=torch.bool)
        m[1] = False
        m[0, S - 5:] = False
    else:
        raise AssertionError(kind)
    return m.to(dev)


def _all_routes():
    from shapewise.model.routing import ROUTES

    return ["auto", *ROUTES]


MASKED_CFGS = {
    "S200": (8, 200, 128, 2, 256, 2),  # head_dim 64, S not a multiple of any tile
    "S100": (8, 100, 96, 3, 160, 2),  # head_dim 32, short and narrow (the one-kernel-per-layer range)
    "S77": (4, 77, 64, 2, 96, 2),  # head_dim 32, one tile of rows (the whole-forward routes' range)
}


@pytest.mark.parametrize("route", _all_routes())
@pytest.mark.parametrize("mask_kind", ["all_true", "prefix", "holes", "left", "one_empty", "holes_transposed"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("shape", sorted(MASKED_CFGS))
@torch.no_grad()
def test_masked_inputs_every_route(shape, route, mask_kind, causal, no_tf32):
    from shapewise.model import (TOLERANCES, BaselineTransformer, TransformerConfig, UserOptimizedTransformer,
                       compare_outputs, generate_random_case)
    from shapewise.model.routing import RouteUnavailable, select_route

    B, S, d, H, f, L = MASKED_CFGS[shape]
    cfg = TransformerConfig(B, S, d, H, f, L, causal)
    dev = torch.device("cuda")
    if route != "auto":
        try:
            select_route(cfg, torch.float32, dev, "general", forced=route)
        except RouteUnavailable as e:
            pytest.skip(f"route {route} does not serve {shape} (model.routing says: {e})")
    torch.manual_seed(5)
    ref = BaselineTransformer(cfg).to(dev).eval()
    opt = UserOptimizedTransformer(cfg, route=route).to(dev).eval()
    opt.load_state_dict(ref.state_dict(), strict=True)
    if mask_kind == "prefix":
        x, mask = generate_random_case(cfg, dev, torch.float32, 99, padding_ratio=0.5)
    elif mask_kind == "all_true":  # the official harness's call without padding
        x, _ = generate_random_case(cfg, dev, torch.float32, 99)
        mask = torch.ones(B, S, dtype=torch.bool, device=dev)
    else:
        x, _ = generate_random_case(cfg, dev, torch.float32, 99)
        mask = _masks(mask_kind.replace("_transposed", ""), B, S, dev)
        if mask_kind.endswith("_transposed"):
            mask = mask.t().contiguous().t()
    r = ref(x, mask)
    y = opt(x, mask)
    y_again = opt(x, mask)  # a second call (graph replay; the same addresses: a graph reading them in place)
    y_third = opt(x, mask)  # ... replayed
    tol = TOLERANCES["official"]
    cmp = compare_outputs(r, y, rtol=tol["rtol"], atol=tol["atol"])
    print(f"[masked  ] route={route:<9} took={opt.last_route.name}/{opt.last_route.precision} mask={mask_kind:<16} "
          f"causal={causal} failed={cmp.failed_elements}/{cmp.total_elements} max_abs={cmp.max_abs_error:.3e}")
    assert cmp.failed_elements == 0, f"{cmp.failed_elements} failed, worst {cmp.worst_index}"
    assert torch.equal(y, y_again) and torch.equal(y, y_third)
    if (~mask).any():
        assert y[~mask].abs().max().item() == 0.0, "invalid rows are not exactly zero"


@pytest.mark.parametrize("route", ["graph", "triton", "fused", "auto"])
@torch.no_grad()
def test_gpu_weight_edit_and_no_aliasing(route, no_tf32):
    """After a first forward (graph captured), an in-place weight edit must show in the next output, and the
    output of call 1 must survive call 2 (the graph's static output buffer is not handed out)."""
    from shapewise.model import TOLERANCES, BaselineTransformer, TransformerConfig, UserOptimizedTransformer, compare_outputs

    cfg = TransformerConfig(4, 128, 128, 4, 128, 2, True)
    dev = torch.device("cuda")
    torch.manual_seed(8)
    ref = BaselineTransformer(cfg).to(dev).eval()
    opt = UserOptimizedTransformer(cfg, route=route).to(dev).eval()
    opt.load_state_dict(ref.state_dict(), strict=True)
    x1 = torch.randn(4, 128, 128, device=dev)
    x2 = torch.randn(4, 128, 128, device=dev)
    y1 = opt(x1)
    keep = y1.clone()
    y2 = opt(x2)
    assert torch.equal(y1, keep), "output of call 1 changed by call 2"
    dict(opt.named_parameters())["layers.1.attention.v_proj.weight"].mul_(-1.0)
    dict(opt.named_parameters())["final_norm.bias"].add_(0.5)
    ref.load_state_dict(opt.state_dict(), strict=True)
    y3 = opt(x2)
    tol = TOLERANCES["official"]
    cmp = compare_outputs(ref(x2), y3, rtol=tol["rtol"], atol=tol["atol"])
    assert cmp.failed_elements == 0, f"after in-place edit: {cmp.failed_elements} failed"
    assert not torch.allclose(y2, y3)


@pytest.mark.parametrize("batch", [1, 131, 132, 1000])
@torch.no_grad()
def test_one_kernel_per_layer_across_batch_sizes(batch, no_tf32):
    """Route 'fused' on S=128, d=128 across batch sizes, in a CUDA graph and eagerly: official tolerance at
    one wave of programs and below (B=1), around the H200's 132 SMs (B=131, 132) and far above it (B=1000).
    Row 6's shape (B=10000) failed with 64-row query blocks, which fused_layer refuses (MAX_BLOCK_M); this keeps
    the grid sizes around it covered."""
    from shapewise.model import TOLERANCES, BaselineTransformer, TransformerConfig, UserOptimizedTransformer, compare_outputs

    cfg = TransformerConfig(batch, 128, 128, 4, 128, 2, True)
    dev = torch.device("cuda")
    torch.manual_seed(3)
    ref = BaselineTransformer(cfg).to(dev).eval()
    results = []
    for disable in ((), ("cuda_graph",)):
        opt = UserOptimizedTransformer(cfg, route="fused", disable=disable).to(dev).eval()
        opt.load_state_dict(ref.state_dict(), strict=True)
        x = torch.randn(batch, 128, 128, device=dev)
        tol = TOLERANCES["official"]
        cmp = compare_outputs(ref(x), opt(x), rtol=tol["rtol"], atol=tol["atol"])
        print(f"[fused   ] B={batch:<5} disable={disable} failed={cmp.failed_elements}/{cmp.total_elements} "
              f"max_abs={cmp.max_abs_error:.3e} worst={tuple(cmp.worst_index)}")
        results.append((disable, cmp.failed_elements))
    assert all(n == 0 for _, n in results), results


@pytest.mark.parametrize("route", ["graph", "fused"])
@torch.no_grad()
def test_graph_reads_repeated_inputs_in_place(route, no_tf32):
    """Once the same x and mask come twice, the graph reads them where they are (no copy in). It must follow
    in-place edits of the caller's tensors, serve other tensors correctly, and equal the model without the switch."""
    from shapewise.model import TOLERANCES, BaselineTransformer, TransformerConfig, UserOptimizedTransformer
    from shapewise.model import compare_outputs

    dev = torch.device("cuda")
    cfg = TransformerConfig(8, 100, 96, 3, 160, 2, True)
    torch.manual_seed(7)
    ref = BaselineTransformer(cfg).to(dev).eval()
    opt = UserOptimizedTransformer(cfg, route=route).to(dev).eval()
    off = UserOptimizedTransformer(cfg, route=route, disable=("direct_input",)).to(dev).eval()
    opt.load_state_dict(ref.state_dict(), strict=True)
    off.load_state_dict(ref.state_dict(), strict=True)
    x = torch.randn(8, 100, 96, device=dev)
    mask = torch.ones(8, 100, dtype=torch.bool, device=dev)
    tol = TOLERANCES["official"]

    def check(y, what):
        cmp = compare_outputs(ref(x, mask), y, rtol=tol["rtol"], atol=tol["atol"])
        assert cmp.failed_elements == 0, f"{what}: {cmp.failed_elements} failed"

    first, second = opt(x, mask), opt(x, mask)  # the second call captures the in-place graph
    assert torch.equal(first, second)
    x.mul_(0.5)  # the caller edits its tensors in place: same addresses, new values
    mask[0, 60:] = False
    mask[3, 10] = False
    y = opt(x, mask)
    check(y, "after in-place edits")
    assert not torch.equal(y, first)
    assert torch.equal(y, off(x, mask)), "the in-place graph and the copying one disagree"
    assert torch.equal(opt(x.clone(), mask.clone()), y), "other tensors with the same values"
