"""Memory-aware forwards (shapewise.model.memory) on the CPU, with a simulated memory budget: streamed
batch chunks give the one-pass result, the decision is taken once per input signature and cap, input + output
that cannot fit is a clear error before any kernel runs, the budget reader honours the CUDA allocator's fraction
and the user's cap, and the pipeline's preflight counts a streamable row as fitting."""

import json
import math
from types import SimpleNamespace

import pytest
import torch
from model_helpers import CPU_ROUTES, build_pair, cfg_of, make_inputs
from shapewise.model import TransformerConfig, memory
from shapewise.model import optimized as optimized_module
from shapewise.model.routing import select_route

CFG = (5, 9, 32, 2, 48, 2)  # B=5: chunks of 2 give passes of 2, 2 and 1
STREAMED_ATOL = 1e-6  # a few fp32 roundings of O(1) outputs


def budget_for_chunk(model, x, mask, chunk):
    """A memory_budget_bytes under which `model` streams x in chunks of `chunk`: the full output plus one pass of
    `chunk` elements (its working set and its own output), over the planner's reserve."""
    whole = model.memory_plan(x, mask, available=(None, "unbounded"))
    part = model.memory_plan(x[:chunk], None if mask is None else mask[:chunk], available=(None, "unbounded"))
    return math.ceil((whole.output_bytes + part.estimate_bytes) / (1 - memory.RESERVE_FRACTION)) + 1


@pytest.fixture
def one_thread():
    """torch's CPU ops on one intra-op thread, restored afterwards: with two threads a CPU op may split a batch of 5
    and one of 2 differently and round a row's sums in another order (seen on a 2-core AMD EPYC, 3.6e-7 on the sdpa
    route), which says nothing about streaming."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("route", ["sdpa", "triton"])
@pytest.mark.parametrize("mask_kind", ["none", "prefix", "holes", "one_empty"])
def test_streamed_forward_matches_one_pass(route, mask_kind, one_thread):
    """Bit-identical on the CPU (one thread) where every op computes a batch element from that element alone in
    the same order: the sdpa route. The triton route's kernels run in Triton's interpreter, whose
    dots are numpy matmuls over blocks of tokens; a token's row may round differently by its place in the block
    (3.6e-7 with numpy 2.4), so there the streamed result is held within STREAMED_ATOL, far below any misplaced
    chunk's error (on a GPU, cuBLAS may pick another kernel for another batch size, so there the memory benchmark
    checks the official tolerance instead)."""
    cfg = cfg_of(CFG)
    _, one_pass = build_pair(cfg, route)
    x, mask = make_inputs(cfg, mask_kind)
    _, streamed = build_pair(cfg, route, memory_budget_bytes=budget_for_chunk(one_pass, x, mask, 2))
    with torch.no_grad():
        want = one_pass(x, mask)
        got = streamed(x, mask)
    plan = streamed.last_memory_plan
    assert (plan.chunk_size, plan.num_chunks, plan.chunks()) == (2, 3, [(0, 2), (2, 4), (4, 5)])
    assert one_pass.last_memory_plan.num_chunks == 1
    assert streamed.last_route.name == route and "streamed in 3 chunks of 2" in streamed.last_route.reason
    assert got.shape == want.shape and got.dtype == want.dtype
    diff = (got - want).abs().max().item()
    if route == "triton":
        assert diff <= STREAMED_ATOL, f"route {route} mask {mask_kind}: max |diff| {diff}"
    else:
        assert torch.equal(got, want), f"route {route} mask {mask_kind}: max |diff| {diff}"


@pytest.mark.parametrize("mask_kind, causal, summaries", [
    ("all_true", True, 0), ("all_true", False, 0), ("prefix", True, 3), ("holes", True, 3)])
def test_streamed_sdpa_chunks_read_an_all_valid_mask_once(mask_kind, causal, summaries, monkeypatch, one_thread):
    """The triton route with SDPA attention (official row 14's), streamed: where every token of the call's mask is
    valid, the call reads that once and its chunks run SDPA unmasked with no mask summary (a host read each);
    other masks are summarized per chunk as before. Either way the streamed output is the one-pass output."""
    from dataclasses import replace

    from shapewise.kernels import mask as mask_kernels

    if "triton" not in CPU_ROUTES:
        pytest.skip("the triton route needs TRITON_INTERPRET=1 on a CPU")
    calls = []
    real = mask_kernels.prefix_lengths
    monkeypatch.setattr(mask_kernels, "prefix_lengths", lambda m, out=None: calls.append(m.shape) or real(m, out))
    cfg = cfg_of(CFG, causal)
    _, one_pass = build_pair(cfg, "triton")
    x, mask = make_inputs(cfg, mask_kind)
    _, streamed = build_pair(cfg, "triton", memory_budget_bytes=budget_for_chunk(one_pass, x, mask, 2))
    for model in (one_pass, streamed):  # SDPA attention as the policy sets it for long rows
        pick = model._select
        monkeypatch.setattr(model, "_select", lambda xb, mb, pick=pick: replace(pick(xb, mb), attention="sdpa",
                                                                                 split_layer=False))
    with torch.no_grad():
        want = one_pass(x, mask)
        calls.clear()
        got = streamed(x, mask)
    assert streamed.last_memory_plan.num_chunks == 3 and len(calls) == summaries, calls
    assert streamed.last_route.attention == ("sdpa" if mask_kind != "holes" else "triton"), str(streamed.last_route)
    assert not streamed._chunks_all_valid  # only inside the streamed call
    diff = (got - want).abs().max().item()
    assert diff <= STREAMED_ATOL, f"mask {mask_kind} causal {causal}: max |diff| {diff}"


def test_streamed_forward_records_each_chunk_route():
    """A chunk whose size routes it elsewhere is run on its own route, and the record says so."""
    cfg = cfg_of(CFG)
    _, model = build_pair(cfg, "sdpa")
    x, mask = make_inputs(cfg, "prefix")
    model.memory_budget_bytes = budget_for_chunk(model, x, mask, 2)
    real_select = model._select

    def select(xb, mb):  # the last pass (one element) takes the reference route
        route = real_select(xb, mb)
        return route if xb.shape[0] > 1 else type(route)("reference", "fp32", "one element", forced=False)

    model._select = select
    _, plain = build_pair(cfg, "reference")
    with torch.no_grad():
        got = model(x, mask)
        want_last = plain(x[4:], mask[4:])
    assert model.last_memory_plan.routes[1].startswith("reference/fp32")
    assert "chunks of 1: reference/fp32" in model.last_route.reason
    assert torch.equal(got[4:], want_last)


def test_decision_is_taken_once_per_signature_and_cap(monkeypatch):
    """A changing free-memory reading never re-decides; a new signature, cap or memory fraction does."""
    cfg = cfg_of(CFG)
    _, model = build_pair(cfg, "sdpa")
    x, mask = make_inputs(cfg, "prefix")
    calls = []

    def reader(device, cap):
        calls.append(cap)
        return 10**9 - 1000 * len(calls), "simulated"  # less free memory on every reading

    monkeypatch.setattr(optimized_module, "available_bytes", reader)
    with torch.no_grad():
        for _ in range(3):
            model(x, mask)
        assert len(calls) == 1
        model(x[:3], mask[:3])  # another signature
        assert len(calls) == 2
        model(x, mask)
        assert len(calls) == 2
        model.memory_budget_bytes = 10**8  # the user's cap moved
        model(x, mask)
        assert calls[-1] == 10**8 and len(calls) == 3
        monkeypatch.setattr(optimized_module, "memory_fraction", lambda device: 0.5)  # the allocator's cap moved
        model(x, mask)
        assert len(calls) == 4


@pytest.mark.parametrize("what", ["output", "one_element"])
def test_input_and_output_that_cannot_fit_is_a_clear_error_before_any_kernel(what):
    cfg = cfg_of(CFG)
    _, probe = build_pair(cfg, "triton")
    x, mask = make_inputs(cfg, "holes")
    out_bytes = x.numel() * x.element_size()
    if what == "output":
        cap = out_bytes  # less the reserve: not even the output fits
    else:
        cap = budget_for_chunk(probe, x, mask, 1) - 2000  # the output fits, one element's pass beside it does not
    _, model = build_pair(cfg, "triton", memory_budget_bytes=cap)

    def no_kernel(*args, **kwargs):
        raise AssertionError("a kernel ran before the memory check")

    model._runner = no_kernel  # every route runs through the runner its signature gets
    with pytest.raises(memory.MemoryBudgetError) as info:
        model(x, mask)
    assert isinstance(info.value, MemoryError)
    message = str(info.value)
    usable = int(cap * (1 - memory.RESERVE_FRACTION))
    assert "x [5, 9, 32] float32" in message and f"only {usable} bytes are available" in message
    assert f"its output needs {out_bytes} bytes" in message
    assert f"memory budget {cap} bytes" in message
    if what == "one_element":
        assert "a pass over one batch element" in message
    assert model.last_route is None


def test_no_budget_on_the_cpu_means_one_pass(monkeypatch):
    monkeypatch.delenv(memory.BUDGET_ENV, raising=False)
    cfg = cfg_of(CFG)
    _, model = build_pair(cfg, "sdpa")
    x, _ = make_inputs(cfg, "none")
    model(x)
    plan = model.last_memory_plan
    assert plan.num_chunks == 1 and plan.available_bytes is None and memory.BUDGET_ENV in plan.reason


def test_user_budget_from_argument_or_environment(monkeypatch):
    monkeypatch.setenv(memory.BUDGET_ENV, "40")
    assert memory.user_budget_bytes() == 40 * 10**9
    assert memory.user_budget_bytes(123) == 123  # the argument wins
    cfg = cfg_of(CFG)
    assert build_pair(cfg, "sdpa")[1].memory_budget_bytes == 40 * 10**9  # read once, at construction
    monkeypatch.setenv(memory.BUDGET_ENV, "lots")
    with pytest.raises(ValueError, match="SHAPEWISE_MEMORY_BUDGET_GB='lots'"):
        memory.user_budget_bytes()
    with pytest.raises(ValueError, match="memory_budget_bytes"):
        memory.user_budget_bytes(-1)


def test_available_bytes_on_cuda_honours_the_fraction_and_the_cap(monkeypatch):
    """The CUDA reader, with torch.cuda's readings simulated: free + cached, bounded by total * fraction - allocated
    and by cap - allocated."""
    GB = 10**9
    state = {"fraction": 1.0}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index: (10 * GB, 80 * GB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda index: 3 * GB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda index: 1 * GB)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda index: state["fraction"])
    monkeypatch.setattr(memory, "_get_fraction", None)  # a CUDA build reads the fraction through torch._C
    device = torch.device("cuda", 0)
    assert memory.available_bytes(device)[0] == 12 * GB  # 10 free + 2 cached
    state["fraction"] = 0.1  # an 8 GB process limit, 1 GB of it allocated
    value, source = memory.available_bytes(device)
    assert value == 7 * GB and "fraction 0.1" in source
    assert memory.available_bytes(device, user_cap=5 * GB)[0] == 4 * GB
    assert memory.memory_fraction(device) == 0.1 and memory.memory_fraction("cpu") is None
    assert memory.available_bytes("cpu")[0] is None and memory.available_bytes("cpu", 7)[0] == 7


def _cuda_plan(B, S, d, H, f, L, available, masked=True):
    """The plan for an official shape on a CUDA device, routes from select_route (no GPU needed)."""
    def working_set(b):
        shape = TransformerConfig(b, S, d, H, f, L, True)
        route = select_route(shape, torch.float32, "cuda", "general" if masked else "none")
        captured = route.name in ("graph", "fused")
        return memory.working_set_bytes(shape, torch.float32, route, captured=captured), str(route)

    inp, out = memory.io_bytes(TransformerConfig(B, S, d, H, f, L), torch.float32)
    return memory.plan_chunks((B, S, d), torch.float32, inp, out, working_set, available, "simulated")


def test_official_rows_14_and_6_plans_on_an_h200_and_under_caps():
    """The memory targets, as planned: row 14 peaks at most input + output + 8 GB with the H200's memory free, and
    plans under a 40 GB cap; row 6 runs in one pass under 24 GB."""
    GB = 10**9
    row14 = (32, 100000, 1024, 16, 1024, 2)
    io14 = 2 * 32 * 100000 * 1024 * 4
    plan = _cuda_plan(*row14, available=143 * GB - io14 // 2)  # an H200 with the input on it
    assert plan.streamed and plan.estimate_bytes - io14 // 2 + io14 <= io14 + 8 * GB
    capped = _cuda_plan(*row14, available=40 * GB - io14 // 2)
    assert capped.streamed and capped.estimate_bytes <= capped.available_bytes
    row6 = _cuda_plan(10000, 128, 128, 4, 128, 4, available=24 * GB - 10000 * 128 * 128 * 4)
    assert not row6.streamed
    with pytest.raises(memory.MemoryBudgetError, match=r"x \[32, 100000, 1024\] float32"):
        _cuda_plan(*row14, available=20 * GB - io14 // 2)  # a 20 GB GPU: the output alone does not fit


def _row(**kw):
    from shapewise.inputs.manifest import normalize_row

    base = {"id": "mem-row", "batch_size": 5, "seq_len": 9, "d_model": 32, "num_heads": 2, "ffn_dim": 48,
            "num_layers": 2, "trials": 1, "route": "sdpa"}
    return normalize_row(dict(base, **kw))


def test_preflight_counts_a_streamable_row_as_fitting(monkeypatch):
    from shapewise.jobs.models import model_config
    from shapewise.jobs.preflight import optimized_fit

    row = _row()
    config = model_config(row)
    cpu = torch.device("cpu")
    monkeypatch.delenv(memory.BUDGET_ENV, raising=False)
    unbounded = optimized_fit(row, config, cpu, ram_budget=10**9, headroom=0.85)
    assert unbounded["fits"] and unbounded["plan"]["num_chunks"] == 1
    # a cap under which the model streams 2 elements per pass (computed as the model computes it)
    from shapewise.jobs.models import build_optimized

    probe = build_optimized(row, config, cpu)
    x = torch.zeros(5, 9, 32)
    mask = torch.ones(5, 9, dtype=torch.bool)
    # the preflight's input is not yet resident: it counts too (16 bytes over: the GB string rounds)
    cap = budget_for_chunk(probe, x, mask, 2) + math.ceil(x.numel() * 4 / (1 - memory.RESERVE_FRACTION)) + 16
    monkeypatch.setenv(memory.BUDGET_ENV, str(cap / 1e9))
    streamed = optimized_fit(row, config, cpu, ram_budget=10**9, headroom=0.85)
    assert streamed["fits"], streamed
    assert streamed["plan"]["num_chunks"] == 3 and streamed["plan"]["chunk_size"] == 2
    assert streamed["io_bytes"] == 2 * x.numel() * 4 and streamed["budget_bytes"] == streamed["plan"]["available_bytes"]
    json.dumps(streamed)  # JSON-ready
    monkeypatch.setenv(memory.BUDGET_ENV, str(x.numel() * 4 / 1e9))  # the input alone
    skipped = optimized_fit(row, config, cpu, ram_budget=10**9, headroom=0.85)
    assert not skipped["fits"] and "its input and output need" in skipped["reason"]
    assert skipped["estimate_bytes"] == unbounded["estimate_bytes"]


def test_preflight_job_records_the_plan(tmp_path, monkeypatch):
    """The job's result: the reference as before, the optimized model with its plan and io_bytes."""
    from shapewise.inputs.manifest import row_json
    from shapewise.jobs import preflight

    monkeypatch.delenv(memory.BUDGET_ENV, raising=False)
    out = tmp_path / "pre.json"
    args = SimpleNamespace(device="cpu", row=row_json(_row()), headroom=0.85, out=str(out),
                           chunked=json.dumps({"batch_samples": 2, "query_block": 64, "query_samples": "all"}))
    assert preflight.main(args) == 0
    result = json.loads(out.read_text())
    assert result["models"]["reference"]["fits"] and preflight.fits(result, "optimized")
    assert result["io_bytes"] == 2 * 5 * 9 * 32 * 4
    assert result["models"]["optimized"]["plan"]["routes"][0].startswith("sdpa/fp32")
    # what each sharing job may take (its lock's parts come from it): the reference fits, so accuracy counts it whole
    run = result["models"]["optimized"]["estimate_bytes"]
    assert result["job_bytes"]["warmup"] == result["job_bytes"]["profile"] == run
    assert result["job_bytes"]["accuracy"] >= result["models"]["reference"]["estimate_bytes"] + result["io_bytes"]


def test_the_chunked_check_counts_its_score_blocks_not_the_whole_scores():
    """Official row 14: two sampled elements' score blocks (2 x 13.1 GB at query_block 1024) dominate the chunked
    reference, which runs beside the sampled output alone (not the whole input and output, 26 GB): at query_block
    512 the optimized run (28.4 GB) sets the accuracy job's peak, at 1024 the reference (37 GB)."""
    from shapewise.jobs.preflight import job_bytes
    from shapewise.model.config import TransformerConfig, parameter_count

    row14 = TransformerConfig(batch_size=32, seq_len=100_000, d_model=1024, num_heads=16, ffn_dim=1024,
                              num_layers=2, causal=True)
    block = 2 * 16 * 1024 * 100_000 * 4
    got = memory.chunked_reference_bytes(row14, 2, 1024)
    assert 2 * block < got < 2 * block + 12 * 2 * 100_000 * 1024 * 4 + 10**9  # and 12 [2, S, d]-sized tensors
    assert memory.chunked_reference_bytes(row14, 1, 1024) < got / 1.9  # per sampled element
    assert memory.chunked_reference_bytes(row14, 2, 10**6) == memory.chunked_reference_bytes(row14, 2, 100_000)
    models = {"optimized": {"fits": True, "estimate_bytes": 28.4e9}, "reference": {"fits": False}}
    weights = 2 * parameter_count(1024, 1024, 2) * 4
    jobs = job_bytes({"dtype": "float32"}, row14, models, {"batch_samples": 2, "query_block": 512})
    assert jobs["profile"] == 28.4e9 and jobs["accuracy"] == 28.4e9 + weights
    sampled_out = 2 * 100_000 * 1024 * 4
    jobs = job_bytes({"dtype": "float32"}, row14, models, {"batch_samples": 2, "query_block": 1024})
    assert jobs["accuracy"] == sampled_out + memory.chunked_reference_bytes(row14, 2, 1024) + weights
    assert 36e9 < jobs["accuracy"] < 38e9
    assert job_bytes({"dtype": "float32"}, row14, {**models, "optimized": {"fits": False}}, {}) == {}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_chunked_check_estimate_bounds_its_peak_on_the_gpu():
    """What chunked_reference_forward allocates on the GPU stays under chunked_reference_bytes, and the estimate is
    not loose by more than half."""
    from shapewise.model import BaselineTransformer
    from shapewise.model.chunked import chunked_reference_forward

    cfg = TransformerConfig(batch_size=4, seq_len=4096, d_model=256, num_heads=8, ffn_dim=512, num_layers=2,
                            causal=True)
    torch.manual_seed(0)
    model = BaselineTransformer(cfg).cuda()
    x = torch.randn(2, cfg.seq_len, cfg.d_model, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = chunked_reference_forward(model, x, torch.ones(2, cfg.seq_len, dtype=torch.bool, device="cuda"),
                                    query_block=512)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    estimate = memory.chunked_reference_bytes(cfg, 2, 512)
    assert out.shape == x.shape and peak <= estimate < 2 * peak, (peak, estimate)


def test_memory_cap_benchmark_runs_on_tiny_shapes(tmp_path):
    """benchmarks/memory_cap.py as a user runs it (`python -m`), on tiny stand-ins of row 14 on the CPU: the
    capped run streams and passes the official tolerance against the chunked reference."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=str(root / "workflow"))
    env.pop(memory.BUDGET_ENV, None)
    out = tmp_path / "mem.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks.memory_cap", str(out), "--tiny",
                           "--runs", "row14,row14-cap40GB"], cwd=root, env=env, capture_output=True, text=True,
                          timeout=600, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    runs = {r["run"]: r for r in json.loads(out.read_text())["runs"]}
    assert set(runs) == {"row14", "row14-cap40GB"}
    assert runs["row14"]["plan"]["num_chunks"] == 1 and runs["row14-cap40GB"]["plan"]["num_chunks"] == 2
    for r in runs.values():
        assert r["status"] == "ran" and r["targets"]["passes"], r
        assert r["accuracy"]["method"] == "chunked_reference_forward" and r["accuracy"]["batch_indices"] == [0, 3]
    assert "row14-cap40GB" in done.stdout and "failed/compared" in done.stdout  # the table
    bad = subprocess.run([sys.executable, "-m", "benchmarks.memory_cap", str(out), "--device", "cpu"], cwd=root,
                         env=env, capture_output=True, text=True, timeout=600, check=False)
    assert bad.returncode == 2 and "--device must be cuda" in bad.stderr
