"""model.routing.select_route: pure, CPU-safe, honours or refuses forced routes, explains itself."""

import dataclasses
import itertools

import pytest
import torch

from shapewise.kernels import PRECISIONS
from shapewise.model import routing
from shapewise.model.config import TransformerConfig
from shapewise.model.routing import ROUTES, Route, RouteUnavailable, select_route

MASK_KINDS = ("none", "prefix", "general")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)

SHAPES = [
    TransformerConfig(batch_size=2, seq_len=33, d_model=64, num_heads=4, ffn_dim=96, num_layers=2, causal=True),
    TransformerConfig(batch_size=1, seq_len=1, d_model=32, num_heads=2, ffn_dim=64, num_layers=1, causal=False),
    TransformerConfig(batch_size=64, seq_len=128, d_model=128, num_heads=4, ffn_dim=128, num_layers=4, causal=True),
    TransformerConfig(batch_size=10000, seq_len=128, d_model=128, num_heads=4, ffn_dim=128, num_layers=4, causal=True),
    TransformerConfig(batch_size=32, seq_len=100000, d_model=1024, num_heads=16, ffn_dim=1024, num_layers=2),
    TransformerConfig(batch_size=2, seq_len=16, d_model=1024, num_heads=2, ffn_dim=64, num_layers=1),  # hd 512
]
SHAPE_IDS = ["small", "S1", "row1", "row6", "row14", "hd512"]


def cpu_capable(name, shape=SHAPES[0], interpret=True):
    try:
        select_route(shape, torch.float32, "cpu", "general", forced=name, interpret=interpret)
        return True
    except RouteUnavailable:
        return False


def test_route_names():
    assert len(set(ROUTES)) == len(ROUTES)
    assert "reference" in ROUTES and "triton" in ROUTES
    assert set(routing.CPU_ROUTES) <= set(ROUTES)


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("device", ["cpu", "cuda", torch.device("cpu"), torch.device("cuda", 0)], ids=str)
@pytest.mark.parametrize("interpret", [True, False])
def test_pure_same_inputs_same_route(shape, device, interpret):
    for dtype, mask_kind in itertools.product(DTYPES, MASK_KINDS):
        a = select_route(shape, dtype, device, mask_kind, interpret=interpret)
        b = select_route(dataclasses.replace(shape), dtype, device, mask_kind, interpret=interpret)
        assert a == b
        assert isinstance(a, Route) and a.name in ROUTES


def test_pure_ignores_environment(monkeypatch):
    """The env var SHAPEWISE_ROUTE is the model's business: select_route reads only its arguments
    (interpret given explicitly)."""
    shape = SHAPES[2]
    a = select_route(shape, torch.float32, "cuda", "none", interpret=False)
    monkeypatch.setenv("SHAPEWISE_ROUTE", "reference")
    monkeypatch.setenv("SHAPEWISE_DISABLE", "everything")
    assert select_route(shape, torch.float32, "cuda", "none", interpret=False) == a


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mask_kind", MASK_KINDS)
@pytest.mark.parametrize("interpret", [True, False])
def test_auto_on_cpu_picks_a_cpu_capable_route(shape, dtype, mask_kind, interpret):
    r = select_route(shape, dtype, torch.device("cpu"), mask_kind, interpret=interpret)
    assert not r.forced
    # the chosen route must itself accept this input when forced (it can serve it)
    forced = select_route(shape, dtype, torch.device("cpu"), mask_kind, forced=r.name, interpret=interpret)
    assert forced.name == r.name
    assert r.name != "graph"
    if not interpret:
        assert r.name != "triton", "triton picked on the CPU without the interpreter"


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mask_kind", MASK_KINDS)
def test_auto_on_cuda_serves_the_input(shape, dtype, mask_kind):
    r = select_route(shape, dtype, "cuda", mask_kind, interpret=False)
    forced = select_route(shape, dtype, "cuda", mask_kind, forced=r.name, interpret=False)
    assert forced.name == r.name
    if shape.head_dim > 256:
        assert r.name not in ("triton", "graph"), "a Triton route picked beyond the kernels' head_dim range"


def test_mask_kind_validated():
    with pytest.raises(ValueError) as ei:
        select_route(SHAPES[0], torch.float32, "cpu", "holes")
    assert "mask_kind" in str(ei.value)


@pytest.mark.parametrize("name", ["graph"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_forced_cuda_only_route_on_cpu_refused(name, dtype):
    with pytest.raises(RouteUnavailable) as ei:
        select_route(SHAPES[0], dtype, "cpu", "none", forced=name, interpret=True)
    assert name in str(ei.value)
    assert isinstance(ei.value, RuntimeError)


def test_forced_triton_on_cpu_needs_interpreter():
    with pytest.raises(RouteUnavailable) as ei:
        select_route(SHAPES[0], torch.float32, "cpu", "none", forced="triton", interpret=False)
    assert "triton" in str(ei.value)
    r = select_route(SHAPES[0], torch.float32, "cpu", "none", forced="triton", interpret=True)
    assert r.name == "triton" and r.forced


def test_forced_triton_refused_beyond_head_dim_range():
    with pytest.raises(RouteUnavailable) as ei:
        select_route(SHAPES[5], torch.float32, "cuda", "none", forced="triton", interpret=False)
    assert "head_dim" in str(ei.value)


@pytest.mark.parametrize("name", ROUTES)
@pytest.mark.parametrize("mask_kind", MASK_KINDS)
def test_forced_route_honoured_on_cuda(name, mask_kind):
    r = select_route(SHAPES[2], torch.float32, "cuda", mask_kind, forced=name, interpret=False, capability=(9, 0))
    assert r.name == name and r.forced
    assert r.reason


@pytest.mark.parametrize("name", ROUTES)
def test_forced_route_on_cpu_is_honoured_or_refused(name):
    """Never silently replaced by another route."""
    try:
        r = select_route(SHAPES[0], torch.float32, "cpu", "general", forced=name, interpret=True)
    except RouteUnavailable as e:
        assert name in str(e)
        assert name not in routing.CPU_ROUTES, f"{name} is listed in CPU_ROUTES but refused on the CPU"
        return
    assert r.name == name and r.forced
    assert name in routing.CPU_ROUTES, f"{name} serves the CPU but is not listed in CPU_ROUTES"


def test_forced_auto_and_none_are_automatic():
    a = select_route(SHAPES[2], torch.float32, "cuda", "none", forced=None, interpret=False)
    b = select_route(SHAPES[2], torch.float32, "cuda", "none", forced="auto", interpret=False)
    assert a == b and not a.forced


def test_unknown_forced_route_is_value_error():
    with pytest.raises(ValueError) as ei:
        select_route(SHAPES[0], torch.float32, "cpu", "none", forced="warp-speed")
    assert "warp-speed" in str(ei.value)
    assert not isinstance(ei.value, RouteUnavailable)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_route_explains_itself(device, dtype):
    r = select_route(SHAPES[2], dtype, device, "prefix", interpret=False)
    assert r.name in ROUTES
    assert r.precision in PRECISIONS
    assert isinstance(r.reason, str) and r.reason.strip()
    d = r.as_dict()
    assert d["name"] == r.name and d["precision"] == r.precision and d["reason"] == r.reason
    assert r.name in str(r)
    import json

    assert json.loads(json.dumps(d)) == d
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.name = "other"


@pytest.mark.parametrize("name", ROUTES)
def test_low_precision_inputs_get_fp16_operands_on_kernel_routes(name):
    """float16 and bfloat16 inputs run fp16 operands on every kernel route (bf16's 8 mantissa bits failed the
    accuracy contract on the H200; fp16 passed), auto or forced, with or without the split layer; `reference` and
    `sdpa` run PyTorch in the input dtype."""
    native = name in ("reference", "sdpa")
    for dtype, expect in ((torch.float16, "fp16"), (torch.bfloat16, "bf16" if native else "fp16")):
        for shape in (SHAPES[0], SHAPES[2], SHAPES[3]):  # the split layer's shapes (row 6) too
            r = select_route(shape, dtype, "cuda", "none", forced=name, interpret=False, capability=(9, 0))
            assert r.precision == expect, f"{name} {dtype}: precision {r.precision}"
            auto = select_route(shape, dtype, "cuda", "none", interpret=False)
            assert auto.precision == "fp16", f"auto {dtype}: {auto}"


def test_low_precision_operands_come_from_the_policy(monkeypatch):
    """The policy's low_precision_operands is the one owner of the rule: changing it changes the kernel routes'
    precision (and the split layer still runs on either 16-bit type), never that of reference and sdpa."""
    monkeypatch.setitem(routing.POLICY, "low_precision_operands", {"float16": "fp16", "bfloat16": "bf16"})
    split = select_route(SHAPES[3], torch.bfloat16, "cuda", "none", forced="graph", interpret=False)
    assert split.precision == "bf16" and split.split_layer
    assert select_route(SHAPES[2], torch.bfloat16, "cuda", "none", forced="fused").precision == "bf16"
    assert select_route(SHAPES[2], torch.float16, "cuda", "none", forced="triton").precision == "fp16"
    assert select_route(SHAPES[2], torch.bfloat16, "cuda", "none", forced="sdpa").precision == "bf16"
    assert select_route(SHAPES[2], torch.float32, "cuda", "none", forced="triton").precision == "fp16"


def test_reference_route_is_exact_fp32():
    r = select_route(SHAPES[2], torch.float32, "cuda", "none", forced="reference", interpret=False)
    assert r.precision == "fp32"


def test_policy_can_send_long_attention_to_sdpa(monkeypatch):
    """The policy knob attention.sdpa_from_seq_len: long rows on the triton route use SDPA attention, masked ones
    too (the model runs SDPA unmasked under a causal prefix mask and our kernel for other masks, per call, and says
    so); null never switches."""
    from shapewise.model import routing

    long_row = TransformerConfig(2, 100_000, 1024, 16, 1024, 2, True)
    monkeypatch.setitem(routing.POLICY, "attention", {"sdpa_from_seq_len": 4096})
    assert select_route(long_row, torch.float32, "cuda").attention == "sdpa"
    masked = select_route(long_row, torch.float32, "cuda", "general")
    assert masked.attention == "sdpa" and "other masks: our kernel" in masked.reason
    monkeypatch.setitem(routing.POLICY, "attention", {"sdpa_from_seq_len": None})
    assert select_route(long_row, torch.float32, "cuda").attention == "triton"


def _fused_any_length():
    """The committed fused policy without its per-sequence bound (the tests below use 128 x 64 sequences)."""
    return {**routing.POLICY["fused"], "max_seq_len_x_d_model": None}


def test_fused_launch_follows_the_policy_buckets(monkeypatch):
    """fused.launch: the first entry whose max_tokens covers batch*seq gives the fused kernel's launch
    configuration, and the route carries it (so every result records which configuration ran)."""
    monkeypatch.setitem(routing.POLICY, "fused", {**_fused_any_length(), "launch": [
        {"max_tokens": 1024, "block_m": 16, "num_warps": 4, "num_stages": 2},
        {"max_tokens": None, "block_m": 64, "num_warps": 4, "num_stages": 1}]})
    small = TransformerConfig(batch_size=8, seq_len=128, d_model=64, num_heads=4, ffn_dim=64, num_layers=1, causal=True)
    large = dataclasses.replace(small, batch_size=9)
    assert select_route(small, torch.float32, "cuda").launch == (16, 4, 2)
    route = select_route(large, torch.float32, "cuda")
    assert route.name == "fused" and route.launch == (64, 4, 1) and "launch=(64, 4, 1)" in str(route)
    assert select_route(large, torch.float32, "cpu", forced="fused", interpret=True).launch == (64, 4, 1)
    assert select_route(large, torch.float32, "cuda", forced="triton").launch == ()
    monkeypatch.setitem(routing.POLICY, "fused", {**_fused_any_length(), "launch": [
        {"max_tokens": 1024, "block_m": 16, "num_warps": 4, "num_stages": 2}]})
    with pytest.raises(ValueError, match="max_tokens null"):
        select_route(large, torch.float32, "cuda")


def test_fused_only_up_to_the_per_sequence_size(monkeypatch):
    """fused.max_seq_len_x_d_model: one program of the fused kernel holds a sequence's activations; longer or wider
    sequences go to the graph route (rows 3 and 4, 128 x 128), null means no bound."""
    monkeypatch.setitem(routing.POLICY, "fused", {**routing.POLICY["fused"], "max_seq_len_x_d_model": 4096})
    short = TransformerConfig(batch_size=64, seq_len=32, d_model=128, num_heads=4, ffn_dim=128, num_layers=4)
    longer = dataclasses.replace(short, batch_size=16, seq_len=128)
    assert select_route(short, torch.float32, "cuda").name == "fused"
    assert select_route(longer, torch.float32, "cuda").name == "graph"
    assert select_route(longer, torch.float32, "cuda", forced="fused").name == "fused"
    monkeypatch.setitem(routing.POLICY, "fused", _fused_any_length())
    assert select_route(longer, torch.float32, "cuda").name == "fused"


def test_fused_launch_entries_can_bound_the_heads(monkeypatch):
    """A launch entry with max_heads serves only shapes with at most that many heads; others fall through to the
    next entry that covers them."""
    monkeypatch.setitem(routing.POLICY, "fused", {**_fused_any_length(), "max_heads": None,
                                                   "max_tokens_x_d_model": 2**24, "launch": [
        {"max_tokens": 8192, "max_heads": 4, "block_m": 32, "num_warps": 4, "num_stages": 2},
        {"max_tokens": None, "block_m": 32, "num_warps": 4, "num_stages": 1, "kv_precompute": True}]})
    few = TransformerConfig(batch_size=64, seq_len=128, d_model=128, num_heads=4, ffn_dim=128, num_layers=1)
    many = dataclasses.replace(few, num_heads=16)
    assert select_route(few, torch.float32, "cuda").launch == (32, 4, 2)
    assert not select_route(few, torch.float32, "cuda").kv_precompute
    route = select_route(many, torch.float32, "cuda")
    assert route.name == "fused" and route.launch == (32, 4, 1) and route.kv_precompute


@pytest.mark.parametrize("tokens, heads, fused", [
    (255, 4, False), (256, 4, True), (8192, 4, True), (8193, 4, False), (2048, 5, False), (2048, 1, True)])
def test_fused_only_inside_the_policy_bounds(monkeypatch, tokens, heads, fused):
    """fused.min_tokens / max_tokens / max_heads bound where `auto` picks the fused route; outside them the
    graph route serves; a forced fused route still serves any shape the kernel supports."""
    monkeypatch.setitem(routing.POLICY, "fused", {**_fused_any_length(), "min_tokens": 256,
                                                   "max_tokens": 8192, "max_heads": 4, "max_tokens_x_d_model": 2**24})
    shape = TransformerConfig(batch_size=tokens, seq_len=1, d_model=16 * heads, num_heads=heads, ffn_dim=64,
                              num_layers=1, causal=True)
    assert select_route(shape, torch.float32, "cuda").name == ("fused" if fused else "graph")
    assert select_route(shape, torch.float32, "cuda", forced="fused").name == "fused"
    monkeypatch.setitem(routing.POLICY, "fused", {**_fused_any_length(), "min_tokens": None,
                                                   "max_tokens": None, "max_heads": None})
    assert select_route(shape, torch.float32, "cuda").name == "fused"


# The committed policy against the routes the H200 measured fastest per official row (reports/h200: the
# fused_layer and flash_attention ablations, the fused sweep, the split-layer runs; docs/decisions.md#routing-policy).
# A policy edit that changes one of these must say why.
OFFICIAL_ROUTES = {1: "graph", 2: "graph", 3: "graph", 4: "graph", 5: "graph", 6: "triton", 7: "fused",
                   8: "graph", 9: "graph", 10: "graph", 11: "graph", 12: "fused", 13: "graph", 14: "triton"}
# The split layer beat the fused kernel on rows 3, 4, 5, 9, 10 and 11 (row 1 tied: its tokens*d leave the fused route)
# and the unfused layer on rows 2, 6 and 13; the fused kernel kept rows 7 and 12 (seq_len*d 4096).
OFFICIAL_SPLIT = {1, 2, 3, 4, 5, 6, 9, 10, 11, 13}
OFFICIAL_KV = set()  # the kv_precompute entry serves no official row


def test_committed_policy_routes_the_official_rows_as_measured():
    from shapewise.inputs.manifest import official_rows

    for n, row in official_rows().items():
        shape = TransformerConfig(**{f: row[f] for f in ("batch_size", "seq_len", "d_model", "num_heads", "ffn_dim",
                                                         "num_layers", "causal")})
        route = select_route(shape, torch.float32, "cuda")
        assert route.name == OFFICIAL_ROUTES[n], f"official row {n}: {route}"
        assert route.attention == ("sdpa" if n == 14 else "triton"), f"official row {n}: {route}"
        assert route.kv_precompute == (n in OFFICIAL_KV), f"official row {n}: {route}"
        assert route.split_layer == (n in OFFICIAL_SPLIT), f"official row {n}: {route}"


def test_policy_can_precompute_keys_and_values(monkeypatch):
    """fused.launch entries may set kv_precompute; the route carries it (and says so), other routes never do."""
    shape = TransformerConfig(batch_size=8, seq_len=128, d_model=64, num_heads=4, ffn_dim=64, num_layers=1, causal=True)
    launch = [{"max_tokens": None, "block_m": 32, "num_warps": 4, "num_stages": 2}]
    monkeypatch.setitem(routing.POLICY, "fused", {**_fused_any_length(), "launch": launch})
    assert select_route(shape, torch.float32, "cuda").kv_precompute is False
    monkeypatch.setitem(routing.POLICY, "fused", {**routing.POLICY["fused"],
                                                   "launch": [{**launch[0], "kv_precompute": True}]})
    route = select_route(shape, torch.float32, "cuda")
    assert route.name == "fused" and route.kv_precompute and "kv=precomputed" in str(route)
    assert route.as_dict()["kv_precompute"] is True
    assert select_route(shape, torch.float32, "cpu", forced="fused", interpret=True).kv_precompute
    assert not select_route(shape, torch.float32, "cuda", forced="triton").kv_precompute


def test_policy_can_set_key_and_ffn_blocks(monkeypatch):
    """fused.launch entries may set key_block and ffn_block; absent, the route carries 0 (the kernel's default)."""
    shape = TransformerConfig(batch_size=8, seq_len=128, d_model=64, num_heads=4, ffn_dim=64, num_layers=1, causal=True)
    launch = {"max_tokens": None, "block_m": 32, "num_warps": 4, "num_stages": 2, "kv_precompute": True}
    monkeypatch.setitem(routing.POLICY, "fused", {**_fused_any_length(), "launch": [launch]})
    route = select_route(shape, torch.float32, "cuda")
    assert (route.key_block, route.ffn_block) == (0, 0) and "key_block" not in str(route)
    monkeypatch.setitem(routing.POLICY, "fused", {**routing.POLICY["fused"],
                                                   "launch": [{**launch, "key_block": 32, "ffn_block": 16}]})
    route = select_route(shape, torch.float32, "cuda")
    assert (route.key_block, route.ffn_block) == (32, 16)
    assert "key_block=32 ffn_block=16" in str(route) and route.as_dict()["key_block"] == 32
    assert select_route(shape, torch.float32, "cuda", forced="graph").key_block == 0


def test_policy_can_split_layers(monkeypatch):
    """split_layer.max_d_model: triton/graph routes up to that width (and within the tail kernel's limit) run split
    layers, forced ones too; null means never; fused routes and SDPA attention never split."""
    small = TransformerConfig(batch_size=64, seq_len=1024, d_model=128, num_heads=4, ffn_dim=128, num_layers=4)
    wide = TransformerConfig(batch_size=64, seq_len=128, d_model=1024, num_heads=4, ffn_dim=1024, num_layers=4)
    monkeypatch.setitem(routing.POLICY, "split_layer", {"max_d_model": None})
    assert not select_route(small, torch.float32, "cuda").split_layer
    monkeypatch.setitem(routing.POLICY, "split_layer", {"max_d_model": 4096})
    route = select_route(small, torch.float32, "cuda")
    assert route.name == "graph" and route.split_layer and "split-layer" in str(route)
    assert route.as_dict()["split_layer"] is True and "split layer" in route.reason
    assert not select_route(wide, torch.float32, "cuda").split_layer  # beyond the tail kernel's d_model
    assert select_route(small, torch.float32, "cpu", forced="triton", interpret=True).split_layer
    fused = TransformerConfig(batch_size=8, seq_len=32, d_model=64, num_heads=4, ffn_dim=64, num_layers=1, causal=True)
    assert select_route(fused, torch.float32, "cuda").name == "fused"
    assert not select_route(fused, torch.float32, "cuda").split_layer
    big = TransformerConfig(batch_size=256, seq_len=1024, d_model=128, num_heads=4, ffn_dim=128, num_layers=4)
    assert select_route(big, torch.float32, "cuda").split_layer  # the triton route
    monkeypatch.setitem(routing.POLICY, "attention", {"sdpa_from_seq_len": 512})
    long_row = select_route(big, torch.float32, "cuda")
    assert long_row.name == "triton" and long_row.attention == "sdpa" and not long_row.split_layer


def test_split_layer_has_a_token_floor(monkeypatch):
    """split_layer.min_tokens: fewer tokens than that keep the unfused layer (the committed policy sets none: launches
    sized to the token count made the split layer win on few tokens too); null or absent means no floor."""
    one = TransformerConfig(batch_size=1, seq_len=128, d_model=128, num_heads=4, ffn_dim=128, num_layers=4, causal=True)
    eight = dataclasses.replace(one, batch_size=8)  # 1024 tokens
    monkeypatch.setitem(routing.POLICY, "split_layer", {"max_d_model": 128, "min_tokens": 1024})
    assert not select_route(one, torch.float32, "cuda").split_layer
    assert not select_route(one, torch.float32, "cuda", forced="graph").split_layer
    route = select_route(eight, torch.float32, "cuda", forced="graph")
    assert route.split_layer and "tokens >= 1024" in route.reason
    monkeypatch.setitem(routing.POLICY, "split_layer", {"max_d_model": 128, "min_tokens": None})
    assert select_route(one, torch.float32, "cuda").split_layer
    monkeypatch.setitem(routing.POLICY, "split_layer", {"max_d_model": 128})
    assert select_route(one, torch.float32, "cuda").split_layer


# ----------------------------------------------------------------------------------------------
# hopper: built for sm_90 alone, picked unasked only where the policy's hopper entry covers the shape
# ----------------------------------------------------------------------------------------------
def _hopper_policy(monkeypatch, max_seq_len=128, min_batch=None, max_heads=None, pair_max_batch=None,
                   pair_max_head_dim=None, eager_min_batch=None, direct_launch=False, producer_max_head_dim=None,
                   duo_max_head_dim=None):
    monkeypatch.setitem(routing.POLICY, "hopper", {"max_seq_len": max_seq_len, "min_batch": min_batch,
                                                   "max_heads": max_heads, "pair_max_batch": pair_max_batch,
                                                   "pair_max_head_dim": pair_max_head_dim,
                                                   "producer_max_head_dim": producer_max_head_dim,
                                                   "duo_max_head_dim": duo_max_head_dim,
                                                   "eager_min_batch": eager_min_batch,
                                                   "direct_launch": direct_launch})


@pytest.mark.parametrize("capability", [(9, 0), (8, 0), (10, 0), None])
def test_hopper_is_picked_only_on_sm90_where_the_policy_covers(monkeypatch, capability):
    _hopper_policy(monkeypatch)
    r = select_route(SHAPES[2], torch.float32, "cuda", "general", interpret=False, capability=capability)
    assert (r.name == "hopper") == (capability == (9, 0)), r
    if r.name == "hopper":
        assert r.precision == "fp16" and "Gluon" in r.reason


def test_hopper_keeps_to_the_policy(monkeypatch):
    _hopper_policy(monkeypatch, max_seq_len=64)
    assert select_route(SHAPES[2], torch.float32, "cuda", capability=(9, 0)).name != "hopper"  # seq_len 128
    _hopper_policy(monkeypatch, max_seq_len=128, min_batch=65)
    assert select_route(SHAPES[2], torch.float32, "cuda", capability=(9, 0)).name != "hopper"  # batch 64
    _hopper_policy(monkeypatch, max_seq_len=128, min_batch=64)
    assert select_route(SHAPES[2], torch.float32, "cuda", capability=(9, 0)).name == "hopper"
    _hopper_policy(monkeypatch, max_heads=2)
    assert select_route(SHAPES[2], torch.float32, "cuda", capability=(9, 0)).name != "hopper"  # 4 heads
    _hopper_policy(monkeypatch, max_heads=4)
    assert select_route(SHAPES[2], torch.float32, "cuda", capability=(9, 0)).name == "hopper"
    _hopper_policy(monkeypatch, max_seq_len=None)
    assert select_route(SHAPES[2], torch.float32, "cuda", capability=(9, 0)).name != "hopper"
    _hopper_policy(monkeypatch)
    assert select_route(SHAPES[2], torch.float32, "cuda", capability=(9, 0), allow_hopper=False).name != "hopper"
    # a shape outside the kernel's limits (d_model 1024) is never picked, even where the policy would
    assert select_route(SHAPES[5], torch.float32, "cuda", capability=(9, 0)).name != "hopper"


def test_hopper_runs_eagerly_beyond_the_graph_bound(monkeypatch):
    # beyond graph.max_tokens_x_d_model the graph's output copy costs more than the one launch it saves
    from shapewise.model import route_hopper
    from shapewise.model.optimized import switches_used

    _hopper_policy(monkeypatch)
    row1 = select_route(SHAPES[2], torch.float32, "cuda", capability=(9, 0))
    row6 = select_route(SHAPES[3], torch.float32, "cuda", capability=(9, 0))
    assert row1.name == row6.name == "hopper" and not row1.eager and row6.eager
    assert " eager (" in str(row6) and "launched eagerly" in row6.reason and row6.as_dict()["eager"] is True
    assert not row6.prepared_launch  # Triton's JIT launch, unless the policy's hopper.eager_min_batch
    assert "cuda_graph" in switches_used(row1, torch.float32, "cuda")
    assert not {"cuda_graph", "direct_input"} & set(switches_used(row6, torch.float32, "cuda"))
    forced = select_route(SHAPES[3], torch.float32, "cuda", forced="hopper", capability=(9, 0))
    assert forced.forced and forced.eager
    # an automatic hopper route without fp16 operands falls back to the graph route, captured
    fallback = route_hopper.settle(dataclasses.replace(row6, precision="fp32"), None, set())
    assert fallback.name == "graph" and not fallback.eager
    monkeypatch.setitem(routing.POLICY, "graph", {"max_tokens_x_d_model": 200_000_000})
    assert not select_route(SHAPES[3], torch.float32, "cuda", capability=(9, 0)).eager


def test_hopper_runs_eagerly_where_the_policy_covers_the_batch(monkeypatch):
    from shapewise.model.optimized import switches_used

    _hopper_policy(monkeypatch, eager_min_batch=65)
    row1 = select_route(SHAPES[2], torch.float32, "cuda", capability=(9, 0))  # batch 64
    assert row1.name == "hopper" and not row1.eager and not row1.prepared_launch
    _hopper_policy(monkeypatch, eager_min_batch=64)
    row1 = select_route(SHAPES[2], torch.float32, "cuda", capability=(9, 0))
    assert row1.name == "hopper" and row1.eager and row1.prepared_launch and "batch 64 >= 64" in row1.reason
    assert " eager prepared-launch (" in str(row1) and row1.as_dict()["prepared_launch"] is True
    assert not row1.direct_launch  # policy hopper.direct_launch off: through the compiled kernel's run
    _hopper_policy(monkeypatch, eager_min_batch=64, direct_launch=True)
    row1 = select_route(SHAPES[2], torch.float32, "cuda", capability=(9, 0))
    assert row1.direct_launch and " prepared-launch direct-launch (" in str(row1) and "built once" in row1.reason
    assert not {"cuda_graph", "direct_input"} & set(switches_used(row1, torch.float32, "cuda"))
    _hopper_policy(monkeypatch, eager_min_batch=1, pair_max_batch=64)  # the pair too: its scratch serves each launch
    both = select_route(SHAPES[2], torch.float32, "cuda", capability=(9, 0))
    assert both.eager and both.pair


def test_hopper_pairs_programs_where_the_policy_and_the_kernel_say_so(monkeypatch):
    from shapewise.model import route_hopper
    from shapewise.model.memory import working_set_bytes
    from shapewise.model.optimized import switches_used

    row1 = SHAPES[2]  # 64 causal sequences of 128 tokens
    _hopper_policy(monkeypatch)  # pair_max_batch null: never
    one = select_route(row1, torch.float32, "cuda", capability=(9, 0))
    assert one.name == "hopper" and not one.pair and "hopper_pair" not in switches_used(
        one, torch.float32, "cuda")
    _hopper_policy(monkeypatch, pair_max_batch=63)
    assert not select_route(row1, torch.float32, "cuda", capability=(9, 0)).pair  # batch 64
    _hopper_policy(monkeypatch, pair_max_batch=64, pair_max_head_dim=16)  # heads of 32
    assert not select_route(row1, torch.float32, "cuda", capability=(9, 0)).pair
    _hopper_policy(monkeypatch, pair_max_batch=64, pair_max_head_dim=32)
    two = select_route(row1, torch.float32, "cuda", capability=(9, 0))
    assert two.name == "hopper" and two.pair and " pair (auto: " in str(two) and "two programs" in two.reason
    assert "hopper_pair" in switches_used(two, torch.float32, "cuda") and two.as_dict()["pair"] is True
    assert select_route(row1, torch.float32, "cuda", forced="hopper", capability=(9, 0)).pair
    # the kernel's pair limits: causal only, 65 to 128 tokens
    for shape in (dataclasses.replace(row1, causal=False), dataclasses.replace(row1, seq_len=64)):
        r = select_route(shape, torch.float32, "cuda", capability=(9, 0))
        assert r.name == "hopper" and not r.pair, r
    # the switch turns it off, saying so; its scratch counts in the memory plan
    off = route_hopper.settle(two, None, {"hopper_pair"})
    assert not off.pair and "hopper_pair disabled" in off.reason
    assert working_set_bytes(row1, torch.float32, two) > working_set_bytes(row1, torch.float32, one)


def test_hopper_loader_warp_where_the_policy_covers_the_head_width(monkeypatch):
    from shapewise.model import route_hopper
    from shapewise.model.optimized import switches_used

    row1 = SHAPES[2]  # heads of 32
    _hopper_policy(monkeypatch)  # producer_max_head_dim null: never
    plain = select_route(row1, torch.float32, "cuda", capability=(9, 0))
    assert plain.name == "hopper" and not plain.producer and "hopper_producer" not in switches_used(
        plain, torch.float32, "cuda")
    _hopper_policy(monkeypatch, producer_max_head_dim=16)
    assert not select_route(row1, torch.float32, "cuda", capability=(9, 0)).producer
    _hopper_policy(monkeypatch, producer_max_head_dim=32, pair_max_batch=64)
    loader = select_route(row1, torch.float32, "cuda", capability=(9, 0))
    assert loader.producer and loader.pair and " pair producer (auto: " in str(loader)
    assert "loader warp" in loader.reason
    assert "hopper_producer" in switches_used(loader, torch.float32, "cuda") and loader.as_dict()["producer"] is True
    off = route_hopper.settle(loader, None, {"hopper_producer"})
    assert not off.producer and off.pair and "hopper_producer disabled" in off.reason


def test_hopper_duo_where_the_policy_and_the_kernel_say_so_in_place_of_pair_and_loader(monkeypatch):
    from shapewise.model import route_hopper
    from shapewise.model.memory import working_set_bytes
    from shapewise.model.optimized import switches_used

    row1 = SHAPES[2]  # 64 causal sequences of 128 tokens, heads of 32
    _hopper_policy(monkeypatch, pair_max_batch=64, producer_max_head_dim=64)  # duo_max_head_dim null: never
    without = select_route(row1, torch.float32, "cuda", capability=(9, 0))
    assert without.pair and without.producer and not without.duo
    assert "hopper_duo" not in switches_used(without, torch.float32, "cuda")
    _hopper_policy(monkeypatch, pair_max_batch=64, producer_max_head_dim=64, duo_max_head_dim=16)
    assert not select_route(row1, torch.float32, "cuda", capability=(9, 0)).duo  # heads of 32
    _hopper_policy(monkeypatch, pair_max_batch=64, producer_max_head_dim=64, duo_max_head_dim=32)
    duo = select_route(row1, torch.float32, "cuda", capability=(9, 0))
    assert duo.name == "hopper" and duo.duo and not duo.pair and not duo.producer, duo
    assert " duo (auto: " in str(duo) and "two warpgroups" in duo.reason and duo.as_dict()["duo"] is True
    used = switches_used(duo, torch.float32, "cuda")
    assert "hopper_duo" in used and not {"hopper_pair", "hopper_producer"} & set(used)
    assert working_set_bytes(row1, torch.float32, duo) < working_set_bytes(row1, torch.float32, without)  # no scratch
    forced = select_route(row1, torch.float32, "cuda", forced="hopper", capability=(9, 0))
    assert forced.forced and forced.duo
    # its switch off: what the policy gives without it, forced or not
    for how in (None, "hopper"):
        off = select_route(row1, torch.float32, "cuda", forced=how, capability=(9, 0), allow_duo=False)
        assert off.pair and off.producer and not off.duo, off
    # the kernel's duo limits: causal only, 65 to 128 tokens (then the policy's pair and loader, where they serve)
    for shape in (dataclasses.replace(row1, causal=False), dataclasses.replace(row1, seq_len=64)):
        r = select_route(shape, torch.float32, "cuda", capability=(9, 0))
        assert r.name == "hopper" and not r.duo and r.producer, r
    assert route_hopper.switches(duo) == {"hopper_forward", "hopper_duo"}


def test_hopper_attention_where_the_policy_says_so_on_sm90(monkeypatch):
    from shapewise.model import route_triton
    from shapewise.model.optimized import switches_used

    row14 = SHAPES[4]  # 100 000 tokens, 16 heads of 64
    monkeypatch.setitem(routing.POLICY, "attention", {"sdpa_from_seq_len": 16384, "hopper_from_seq_len": None})
    assert select_route(row14, torch.float32, "cuda", capability=(9, 0)).attention == "sdpa"  # null: never
    monkeypatch.setitem(routing.POLICY, "attention", {"sdpa_from_seq_len": 16384, "hopper_from_seq_len": 32768})
    r = select_route(row14, torch.float32, "cuda", "general", capability=(9, 0))
    assert r.name == "triton" and r.attention == "hopper" and "+hopper-attention" in str(r) and "Gluon" in r.reason
    assert "hopper_attention" in switches_used(r, torch.float32, "cuda")
    for capability in (None, (8, 0), (10, 0)):  # built for sm_90 alone
        assert select_route(row14, torch.float32, "cuda", capability=capability).attention == "sdpa"
    assert select_route(dataclasses.replace(row14, seq_len=20000), torch.float32, "cuda",
                        capability=(9, 0)).attention == "sdpa"  # below hopper_from_seq_len
    assert select_route(dataclasses.replace(row14, num_heads=8), torch.float32, "cuda",
                        capability=(9, 0)).attention == "hopper"  # head_dim 128 is served ...
    wide = dataclasses.replace(row14, num_heads=32)  # ... head_dim 32 is not
    assert select_route(wide, torch.float32, "cuda", capability=(9, 0)).attention == "sdpa"
    # the switch, and operands other than fp16 (the fp16 screen's bf16), give back the policy's attention without it
    x = torch.empty(1, row14.seq_len, 0)
    off = route_triton.settle(r, x, {"hopper_attention"})
    assert off.attention == "sdpa" and "hopper_attention disabled" in off.reason
    bf16 = route_triton.settle(dataclasses.replace(r, precision="bf16"), x, set())
    assert bf16.attention == "sdpa" and "bf16 operands" in bf16.reason


def test_hopper_linear_where_the_policy_says_so_on_sm90(monkeypatch):
    from shapewise.model import route_triton
    from shapewise.model.optimized import switches_used

    row14 = SHAPES[4]  # d_model 1024: the triton route
    row8 = TransformerConfig(batch_size=64, seq_len=128, d_model=1024, num_heads=4, ffn_dim=1024, num_layers=4)
    monkeypatch.setitem(routing.POLICY, "hopper_linear", {"min_d_model": None})
    assert not select_route(row14, torch.float32, "cuda", capability=(9, 0)).hopper_linear  # null: never
    monkeypatch.setitem(routing.POLICY, "hopper_linear", {"min_d_model": 512})
    for shape, name in ((row14, "triton"), (row8, "graph")):
        r = select_route(shape, torch.float32, "cuda", "general", capability=(9, 0))
        assert r.name == name and r.hopper_linear and " hopper-linear" in str(r) and "d_model >= 512" in r.reason
        assert "hopper_linear" in switches_used(r, torch.float32, "cuda")
        for capability in (None, (8, 0), (10, 0)):  # built for sm_90 alone
            assert not select_route(shape, torch.float32, "cuda", capability=capability).hopper_linear
        forced = select_route(shape, torch.float32, "cuda", forced=name, capability=(9, 0))
        assert forced.forced and forced.hopper_linear
    # below the policy's d_model, on the split layer's rows (its own tail), or rows TMA cannot address (16-byte
    # rows): the unfused layer as before
    assert not select_route(dataclasses.replace(row8, d_model=256, num_heads=2), torch.float32, "cuda",
                            capability=(9, 0)).hopper_linear
    monkeypatch.setitem(routing.POLICY, "hopper_linear", {"min_d_model": 64})
    row1 = dataclasses.replace(SHAPES[2], batch_size=16)  # graph with the split layer
    split = select_route(row1, torch.float32, "cuda", capability=(9, 0), allow_hopper=False)
    assert split.split_layer and not split.hopper_linear, split
    assert not select_route(dataclasses.replace(row8, ffn_dim=1020), torch.float32, "cuda",
                            capability=(9, 0)).hopper_linear
    # the switch, and fp32 operands (a model's precision argument), give back the unfused layer, saying why
    r = select_route(row8, torch.float32, "cuda", capability=(9, 0))
    x = torch.empty(1, row8.seq_len, 0)
    off = route_triton.settle(r, x, {"hopper_linear"})
    assert not off.hopper_linear and "hopper_linear disabled" in off.reason
    assert "hopper_linear" not in switches_used(off, torch.float32, "cuda")
    fp32 = route_triton.settle(dataclasses.replace(r, precision="tf32"), x, set())
    assert not fp32.hopper_linear and "tf32 operands" in fp32.reason


def test_eager_tail_where_the_policy_says_so():
    """The graph route's last kernel outside the graph from the policy's graph.eager_tail_min_tokens_x_d_model on:
    official rows 8 and 13 (2^23), unfused or split; not the small graph rows, nor the triton route."""
    from shapewise.model import route_triton
    from shapewise.model.optimized import switches_used

    row8 = TransformerConfig(batch_size=64, seq_len=128, d_model=1024, num_heads=4, ffn_dim=1024, num_layers=4)
    row13 = TransformerConfig(batch_size=64, seq_len=1024, d_model=128, num_heads=4, ffn_dim=128, num_layers=4)
    row11 = dataclasses.replace(SHAPES[2], num_heads=16)
    least = routing.POLICY["graph"]["eager_tail_min_tokens_x_d_model"]
    assert row11.tokens * row11.d_model < least <= row8.tokens * row8.d_model == row13.tokens * row13.d_model
    for shape in (row8, row13):
        r = select_route(shape, torch.float32, "cuda", capability=(9, 0), allow_hopper=False)
        assert r.name == "graph" and r.eager_tail and " eager-tail" in str(r) and f">= {least}" in r.reason, r
        assert "eager_tail" in switches_used(r, torch.float32, "cuda")
        assert select_route(shape, torch.float32, "cuda", forced="graph", capability=(9, 0)).eager_tail
        assert not select_route(shape, torch.float32, "cuda", forced="triton", capability=(9, 0)).eager_tail
        x = torch.empty(1, shape.seq_len, 0)
        for off in ({"eager_tail"}, {"cuda_graph"}):
            settled = route_triton.settle(r, x, off)
            assert not settled.eager_tail and f"{next(iter(off))} disabled" in settled.reason
            assert "eager_tail" not in switches_used(settled, torch.float32, "cuda")
    assert select_route(row13, torch.float32, "cuda", capability=(9, 0)).split_layer
    assert not select_route(row11, torch.float32, "cuda", capability=(9, 0), allow_hopper=False).eager_tail
    assert not select_route(SHAPES[4], torch.float32, "cuda", capability=(9, 0)).eager_tail  # row 14: triton


@pytest.mark.parametrize("capability", [(8, 0), (10, 0)])
def test_forced_hopper_is_refused_off_sm90_naming_the_capability(capability):
    with pytest.raises(RouteUnavailable, match=r"'hopper'.*9\.x.*got " + f"{capability[0]}.{capability[1]}"):
        select_route(SHAPES[2], torch.float32, "cuda", forced="hopper", capability=capability)


def test_forced_hopper_is_refused_where_the_kernel_cannot_serve():
    with pytest.raises(RouteUnavailable, match="'hopper'.*seq_len <= 128"):
        select_route(dataclasses.replace(SHAPES[2], seq_len=129), torch.float32, "cuda", forced="hopper",
                     capability=(9, 0))
    with pytest.raises(RouteUnavailable, match="'hopper'.*d_model in"):
        select_route(dataclasses.replace(SHAPES[2], d_model=256, num_heads=8), torch.float32, "cuda",
                     forced="hopper", capability=(9, 0))


def test_hopper_tail_where_the_policy_says_so_on_sm90(monkeypatch):
    from shapewise.model import route_triton
    from shapewise.model.optimized import switches_used

    row13 = TransformerConfig(batch_size=64, seq_len=1024, d_model=128, num_heads=4, ffn_dim=128, num_layers=4)
    split = {**routing.POLICY["split_layer"], "hopper_ln_qkv_min_tokens": None, "hopper_tail_min_tokens": None}
    monkeypatch.setitem(routing.POLICY, "split_layer", {**split, "hopper_tail_min_tokens": None})
    assert not select_route(row13, torch.float32, "cuda", capability=(9, 0)).hopper_tail  # null: never
    monkeypatch.setitem(routing.POLICY, "split_layer", {**split, "hopper_tail_min_tokens": 32768})
    r = select_route(row13, torch.float32, "cuda", "general", capability=(9, 0))
    assert r.split_layer and r.hopper_tail and " hopper-tail" in str(r) and "tokens >= 32768" in r.reason, r
    assert "hopper_tail" in switches_used(r, torch.float32, "cuda")
    for capability in (None, (8, 0), (10, 0)):  # built for sm_90 alone
        assert not select_route(row13, torch.float32, "cuda", capability=capability).hopper_tail
    forced = select_route(row13, torch.float32, "cuda", forced="triton", capability=(9, 0))
    assert forced.forced and forced.hopper_tail
    # fewer tokens, a width the kernel does not serve, or no split layer: the Triton tail or the unfused layer
    assert not select_route(dataclasses.replace(row13, seq_len=256), torch.float32, "cuda",
                            capability=(9, 0)).hopper_tail
    assert not select_route(dataclasses.replace(row13, ffn_dim=96), torch.float32, "cuda",
                            capability=(9, 0)).hopper_tail
    x = torch.empty(1, row13.seq_len, 0)
    off = route_triton.settle(r, x, {"hopper_tail"})
    assert off.split_layer and not off.hopper_tail and "hopper_tail disabled" in off.reason
    assert "hopper_tail" not in switches_used(off, torch.float32, "cuda")
    unsplit = route_triton.settle(r, x, {"split_layer"})
    assert not unsplit.split_layer and not unsplit.hopper_tail and "no split layer" in unsplit.reason
    # the LayerNorm + QKV by its own policy entry and switch
    assert not r.hopper_ln_qkv
    monkeypatch.setitem(routing.POLICY, "split_layer", {**split, "hopper_ln_qkv_min_tokens": 4096})
    both = select_route(row13, torch.float32, "cuda", capability=(9, 0))
    assert both.hopper_ln_qkv and not both.hopper_tail and " hopper-ln-qkv" in str(both), both
    assert "hopper_ln_qkv" in switches_used(both, torch.float32, "cuda")
    off = route_triton.settle(both, x, {"hopper_ln_qkv"})
    assert not off.hopper_ln_qkv and "hopper_ln_qkv disabled" in off.reason
