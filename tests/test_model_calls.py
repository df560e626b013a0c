"""Calls of one UserOptimizedTransformer share its state (memory plans, captured graphs' static buffers, the program
pair's scratch, derived weights): threads take turns at forward (CPU), calls on different CUDA streams run on the
GPU in the order they were made (H200), and a copy or a pickle of the model makes its own lock."""

import copy
import pickle
import threading
import time

import pytest
import torch

from model_helpers import build_pair, cfg_of, make_inputs

CFG = (2, 7, 32, 4, 48, 2)


class _SlowRunner:
    """A runner that takes 50 ms and records when it ran."""

    uses_weights = True

    def __init__(self, route, spans):
        self.route, self.spans = route, spans

    def __call__(self, model, x, mask):
        start = time.perf_counter()
        time.sleep(0.05)
        self.spans.append((start, time.perf_counter()))
        return x


def test_threads_take_turns_at_forward():
    cfg = cfg_of(CFG)
    _, opt = build_pair(cfg, "sdpa")
    x, mask = make_inputs(cfg, "holes")
    with torch.no_grad():
        opt(x, mask)
    key = (x.shape, x.dtype, x.device, False)
    spans = []
    opt._paths[key] = _SlowRunner(opt._paths[key].route, spans)
    threads = [threading.Thread(target=opt, args=(x, mask)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    spans.sort()
    assert len(spans) == 4 and all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), spans


def test_a_copy_and_a_pickle_make_their_own_lock():
    cfg = cfg_of(CFG)
    _, opt = build_pair(cfg, "sdpa")
    x, mask = make_inputs(cfg, "prefix")
    with torch.no_grad():
        want = opt(x, mask)
        for twin in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
            assert twin._calls is not opt._calls and twin._stream is None
            assert torch.equal(twin(x, mask), want)
            with twin._calls:  # re-entrant: a streamed forward's chunks call forward again from the same thread
                assert torch.equal(twin(x, mask), want)


def test_an_eager_tail_is_the_runners_finish_on_what_the_graph_staged():
    """A captured forward with eager_tail hands out its runner's `finish` of the staged tensors; without it, a copy
    of the graph's own output. The graph route's runners are StagedRunners."""
    from shapewise.model import route_triton
    from shapewise.model.captured import CapturedForward, Captures
    from shapewise.model.route import StagedRunner

    class Inner:
        route, uses_weights = "graph", True

        def __call__(self, model, x, mask):
            return self.finish(model, self.stage(model, x, mask))

        def stage(self, model, x, mask):
            return (x,)

        def finish(self, model, staged, pdl=False):
            return staged[0] * 2

    staged = torch.ones(3)
    assert isinstance(Inner(), StagedRunner)
    assert torch.equal(CapturedForward(Inner(), Captures(), True, eager_tail=True)._output(None, (staged,)),
                       torch.full((3,), 2.0))
    copy = CapturedForward(Inner(), Captures(), True)._output(None, staged)
    assert torch.equal(copy, staged) and copy.data_ptr() != staged.data_ptr()
    for cls in (route_triton.KernelForward, route_triton.SplitLayerForward):
        assert all(callable(getattr(cls, name, None)) for name in ("stage", "finish")), cls


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("route, eager_tail", [("graph", False), ("graph", True), ("auto", False)])
def test_calls_on_two_streams_run_in_order(monkeypatch, route, eager_tail):
    """A call queued behind a long kernel on stream A, then one on stream B: B waits for A's call, so A's output is
    its own (a captured graph's static output is written by each call and copied out after it, or with eager_tail
    its staged tensors read by the last kernel launched after it)."""
    from shapewise.model import routing

    monkeypatch.setitem(routing.POLICY, "graph", {**routing.POLICY["graph"],
                                                  "eager_tail_min_tokens_x_d_model": 1 if eager_tail else None})
    cfg = cfg_of((64, 128, 128, 4, 128, 4))
    _, opt = build_pair(cfg, route)
    opt = opt.cuda()
    x1, mask = make_inputs(cfg, "all_true", seed=1)
    x2, _ = make_inputs(cfg, "all_true", seed=2)
    x1, x2, mask = x1.cuda(), x2.cuda(), mask.cuda()
    with torch.inference_mode():
        for _ in range(3):  # compiled and captured: later calls replay
            want1, want2 = opt(x1, mask), opt(x2, mask)
        a, b = torch.cuda.Stream(), torch.cuda.Stream()
        a.wait_stream(torch.cuda.current_stream())
        b.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(a):
            torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time before A's call starts
            y1 = opt(x1, mask)
        with torch.cuda.stream(b):
            y2 = opt(x2, mask)
        torch.cuda.synchronize()
    assert torch.equal(y1, want1) and torch.equal(y2, want2), opt.last_route
    assert opt.last_route.eager_tail == eager_tail, opt.last_route


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("d_model", [128, 256], ids=["split", "unfused"])
@pytest.mark.parametrize("mask_kind", ["none", "all_true", "prefix", "holes"])
def test_the_graphs_last_kernel_after_the_replay(monkeypatch, d_model, mask_kind):
    """Policy graph.eager_tail_min_tokens_x_d_model covering the shape: the graph ends before the forward's last
    kernel, which each call launches into a new output: bit for bit the output of the graph that captures it
    (switch eager_tail off), through the graph that copies the inputs in and the one that reads them in place, on
    the split and the unfused layer and every mask kind; every output a tensor of its own."""
    from shapewise.model import routing

    monkeypatch.setitem(routing.POLICY, "graph", {**routing.POLICY["graph"], "eager_tail_min_tokens_x_d_model": 1})
    cfg = cfg_of((4, 64, d_model, 4, 256, 2))
    _, opt = build_pair(cfg, "graph")
    _, off = build_pair(cfg, "graph", disable=("eager_tail",))
    off.load_state_dict(opt.state_dict())
    opt, off = opt.cuda(), off.cuda()
    x, mask = make_inputs(cfg, mask_kind)
    x, mask = x.cuda(), None if mask is None else mask.cuda()
    x2 = x.flip(0).contiguous()
    with torch.inference_mode():
        # the copy-in graph, then the direct one (the same addresses twice), then the copy-in graph again
        got = [opt(x, mask) for _ in range(3)] + [opt(x2, mask)]
        want = [off(x, mask) for _ in range(3)] + [off(x2, mask)]
    assert opt.last_route.eager_tail and not off.last_route.eager_tail, (opt.last_route, off.last_route)
    assert opt.last_route.split_layer == (d_model == 128), opt.last_route
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"call {i}: {opt.last_route}"
    assert len({t.data_ptr() for t in got}) == len(got)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_caller_can_capture_the_model_on_another_stream():
    """Warm on the default stream, then captured in the caller's CUDA graph on a side stream: the call adds no
    dependency on work outside the capture, and the replay gives the eager output."""
    cfg = cfg_of((4, 64, 64, 4, 96, 2))
    _, opt = build_pair(cfg, "triton")
    opt = opt.cuda()
    x, mask = make_inputs(cfg, "holes")
    x, mask = x.cuda(), mask.cuda()
    with torch.inference_mode(False), torch.no_grad():
        want = opt(x, mask).clone()  # compiled, on the default stream
        graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.graph(graph, stream=side):  # the model's first call on this stream
            y = opt(x, mask)
        torch.cuda.current_stream().wait_stream(side)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, want)
        assert torch.equal(opt(x, mask), want)  # and an eager call after it, on the default stream


def test_a_known_call_skips_the_checks_and_anything_new_is_checked(monkeypatch):
    """The second call of a signature is one lookup: no input check, no memory plan; a mask of another dtype, a new
    memory cap or edited weights take the checked path again, and bad inputs still get their named errors."""
    from shapewise.model import optimized

    cfg = cfg_of(CFG)
    _, opt = build_pair(cfg, "triton")  # a route of derived weights (the interpreter on a CPU)
    x, mask = make_inputs(cfg, "holes")
    checks = []
    real = optimized.check_inputs
    monkeypatch.setattr(optimized, "check_inputs", lambda *a: (checks.append(1), real(*a)))
    with torch.no_grad():
        want = opt(x, mask)
        assert len(checks) == 1
        for _ in range(3):
            assert torch.equal(opt(x, mask), want)
        assert len(checks) == 1 and opt.last_memory_plan.num_chunks == 1
        with pytest.raises(TypeError, match="valid_token_mask must have dtype torch.bool"):
            opt(x, mask.to(torch.uint8))
        with pytest.raises(ValueError, match="valid_token_mask has shape"):
            opt(x, mask[:, :-1])
        with pytest.raises(TypeError, match="x must be a torch.Tensor"):
            opt(x.numpy(), mask)
        assert len(checks) == 4
        opt.memory_budget_bytes = 10**12
        opt(x, mask)
        assert len(checks) == 5
        opt(x, mask)
        assert len(checks) == 5
        opt.layers[0].ffn_in.bias.add_(1.0)  # the weights moved: derived again on the checked path
        assert not torch.equal(opt(x, mask), want) and len(checks) == 6
