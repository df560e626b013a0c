"""The split layer's two tail variants, off in the committed policy: the next layer's LayerNorm 1 and QKV projection
folded into each tail (`split_layer.fold_next_qkv`, switch `fold_qkv`) and the persistent tail
(`split_layer.persistent_tail`, switch `persistent_tail`): the routes they give, the kernels a forward launches, and
the model's output against the reference and against the plain split layer, masks with holes and an empty sequence
included.

CPU (the interpreter) and, with the `gpu` marker, the H200 (`pytest -m gpu tests/test_split_tail_variants.py`).
"""
import pytest
import torch

from shapewise.model import (TOLERANCES, BaselineTransformer, TransformerConfig, UserOptimizedTransformer,
                             compare_outputs, routing)
from shapewise.model.optimized import switches_used
from shapewise.model.routing import Route
from shapewise.report_data import route_label

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
CFG = dict(batch_size=3, seq_len=13, d_model=48, num_heads=3, ffn_dim=80, num_layers=3, causal=True)


@pytest.fixture
def fold_on(monkeypatch):
    monkeypatch.setitem(routing.POLICY, "split_layer", {**routing.POLICY["split_layer"], "fold_next_qkv": True})


def _models(route="triton", **cfg):
    config = TransformerConfig(**{**CFG, **cfg})
    torch.manual_seed(3)
    ref = BaselineTransformer(config).to(DEVICE).eval()
    opt = UserOptimizedTransformer(config, route=route).to(DEVICE).eval()
    opt.load_state_dict(ref.state_dict(), strict=True)
    plain = UserOptimizedTransformer(config, route=route, disable=("fold_qkv",)).to(DEVICE).eval()
    plain.load_state_dict(ref.state_dict(), strict=True)
    return config, ref, opt, plain


def _mask(kind, B, S):
    if kind == "none":
        return None
    m = torch.ones(B, S, dtype=torch.bool)
    if kind == "holes":
        m[0, 2::3] = False
        m[1, S // 2:] = False
        m[2] = False  # a sequence with no valid token
    return m.to(DEVICE)


def test_the_policy_entry_is_off_and_turns_the_fold_on(fold_on):
    shape = routing.Shape(**CFG)
    route = routing.select_route(shape, torch.float32, "cuda", forced="graph")
    assert route.split_layer and route.fold_qkv and " fold-qkv" in str(route)
    assert route_label(route.as_dict()) == "graph+split+fold (forced)"
    assert "fold_qkv" in switches_used(route, torch.float32, "cuda")


def test_the_committed_policy_does_not_fold():
    assert routing.POLICY["split_layer"]["fold_next_qkv"] is False
    assert not routing.select_route(routing.Shape(**CFG), torch.float32, "cuda", forced="graph").fold_qkv


@pytest.mark.parametrize("mask_kind", ["none", "all-true", "holes"])
def test_folded_model_matches_the_reference_and_the_unfolded_route(fold_on, mask_kind):
    config, ref, opt, plain = _models()
    g = torch.Generator().manual_seed(5)
    x = torch.randn(config.batch_size, config.seq_len, config.d_model, generator=g).to(DEVICE)
    mask = _mask(mask_kind, config.batch_size, config.seq_len)
    with torch.no_grad():
        want, got, unfolded = ref(x, mask), opt(x, mask), plain(x, mask)
    assert opt.last_route.fold_qkv and not plain.last_route.fold_qkv and plain.last_route.split_layer
    assert compare_outputs(want, got, **TOLERANCES["official"]).passed
    assert (got - unfolded).abs().max().item() <= 2e-3  # the same math in other tiles
    if mask is not None and (~mask).any():
        assert got[~mask].abs().max().item() == 0.0


def test_a_folded_forward_launches_ln_qkv_once(fold_on):
    from shapewise.model import route_triton

    config, _, opt, _ = _models()
    runner = route_triton.runner(opt, Route("graph", "fp16", "r", split_layer=True, fold_qkv=True))
    calls = []
    ln_qkv, tail = runner.ln_qkv, runner.layer_tail
    runner.ln_qkv = lambda *a, **k: calls.append("ln_qkv") or ln_qkv(*a, **k)
    runner.layer_tail = lambda *a, **k: calls.append("tail+qkv" if k.get("next_layer") else "tail") or tail(*a, **k)
    runner.flash_attention = (lambda f: lambda *a, **k: calls.append("attention") or f(*a, **k))(
        runner.flash_attention)
    x = torch.randn(config.batch_size, config.seq_len, config.d_model).to(DEVICE)
    with torch.no_grad():
        runner(opt, x, None)
    assert calls == ["ln_qkv", "attention", "tail+qkv", "attention", "tail+qkv", "attention", "tail"]


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["fold_next_qkv", "persistent_tail"])
@pytest.mark.parametrize("mask_kind", ["all-true", "holes"])
@pytest.mark.parametrize("shape", [dict(batch_size=64, seq_len=128, d_model=128, num_heads=4, ffn_dim=128,
                                        num_layers=4), dict(batch_size=3, seq_len=77, d_model=64, num_heads=2,
                                                            ffn_dim=96, num_layers=3)])
def test_tail_variants_on_the_gpu(monkeypatch, variant, shape, mask_kind):
    monkeypatch.setitem(routing.POLICY, "split_layer", {**routing.POLICY["split_layer"], variant: True})
    config, ref, opt, _ = _models(route="graph", **shape)
    plain = UserOptimizedTransformer(config, route="graph", disable=("fold_qkv", "persistent_tail")).to(DEVICE)
    plain.load_state_dict(ref.state_dict(), strict=True)
    x = torch.randn(config.batch_size, config.seq_len, config.d_model, device=DEVICE)
    mask = _mask(mask_kind, config.batch_size, config.seq_len)
    before, torch.backends.cuda.matmul.allow_tf32 = torch.backends.cuda.matmul.allow_tf32, False
    try:
        with torch.no_grad():
            want = ref(x, mask)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    with torch.no_grad():
        for _ in range(3):  # first call, copy-in graph, direct graph
            got, unfolded = opt(x, mask), plain(x, mask)
            assert compare_outputs(want, got, **TOLERANCES["official"]).passed
            assert (got - unfolded).abs().max().item() <= 2e-3
    assert getattr(opt.last_route, {"fold_next_qkv": "fold_qkv"}.get(variant, variant))


@pytest.mark.parametrize("how", [["--switch", "fold_qkv", "--policy", "split_layer.fold_next_qkv=true"],
                                 ["--switch", "none", "--policy-on", "split_layer.fold_next_qkv=true"]],
                         ids=["switch", "policy-on"])
def test_the_switch_benchmark_runs_the_fold_on_a_tiny_row(tmp_path, how):
    """benchmarks/switch_ab.py as a user runs it (`python -m`) on its tiny CPU row, with the policy entry set for the
    run and the switch off in the second model, or set while the first picks its route alone: the first model
    folds, the second does not, and the first passes the official check."""
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
    assert " fold-qkv" in rec["route"] and " fold-qkv" not in rec["route_off"]
    assert rec["accuracy"]["official"]["failed_elements"] == 0 and rec["max_abs_difference"] <= 2e-3


@pytest.fixture
def persistent_on(monkeypatch):
    monkeypatch.setitem(routing.POLICY, "split_layer", {**routing.POLICY["split_layer"], "persistent_tail": True})


def test_persistent_tail_route_and_its_limit(persistent_on):
    route = routing.select_route(routing.Shape(**CFG), torch.float32, "cuda", forced="graph")
    assert route.persistent_tail and " persistent-tail" in str(route) and "+ptail" in route_label(route.as_dict())
    assert "persistent_tail" in switches_used(route, torch.float32, "cuda")
    wide = routing.select_route(routing.Shape(**{**CFG, "ffn_dim": 256}), torch.float32, "cuda", forced="graph")
    assert wide.split_layer and not wide.persistent_tail  # its FFN does not fit the persistent tail's shared memory


def test_the_committed_policy_runs_no_persistent_tail():
    assert routing.POLICY["split_layer"]["persistent_tail"] is False


@pytest.mark.parametrize("fold", [False, True], ids=["persistent", "fold+persistent-last"])
@pytest.mark.parametrize("mask_kind", ["all-true", "holes"])
def test_persistent_tails_match_the_reference(persistent_on, monkeypatch, fold, mask_kind):
    if fold:
        monkeypatch.setitem(routing.POLICY, "split_layer", {**routing.POLICY["split_layer"], "fold_next_qkv": True})
    config, ref, opt, _ = _models()
    plain = UserOptimizedTransformer(config, route="triton", disable=("persistent_tail", "fold_qkv")).to(DEVICE)
    plain.load_state_dict(ref.state_dict(), strict=True)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(config.batch_size, config.seq_len, config.d_model, generator=g).to(DEVICE)
    mask = _mask(mask_kind, config.batch_size, config.seq_len)
    with torch.no_grad():
        want, got, other = ref(x, mask), opt(x, mask), plain(x, mask.clone())
    assert opt.last_route.persistent_tail and opt.last_route.fold_qkv == fold
    assert not plain.last_route.persistent_tail
    assert compare_outputs(want, got, **TOLERANCES["official"]).passed
    assert (got - other).abs().max().item() <= 2e-3
