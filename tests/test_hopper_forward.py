"""kernels/hopper_forward.py and route `hopper`: the weight stream's layout (CPU: the forward computed from the packed
tiles equals an fp64 forward written independently of it, padded heads and FFN chunks included; so does the pair
variant's order of it, two halves of a causal sequence), the kernel's limits, its sm_90 build (offline, no GPU), and
on an H200 the kernel (pair too) and the route against fp64 on every mask kind."""

import contextlib
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch
from shapewise.kernels import hopper_forward as hf
from shapewise.model import route_hopper
from shapewise.model.reference import LAYER_NORM_EPS as EPS
from shapewise.model.routing import Route
from shapewise.model.weights import layer_weights, per_layer

from model_helpers import MASK_KINDS, build_pair, cfg_of, check_official, fp64_forward, make_inputs

ROOT = Path(__file__).resolve().parent.parent
CUDA = torch.cuda.is_available()

# (B, S, d, H, ffn, L): head dims 32, 128, 64, 8 (padded to 16), 16; FFN wider, narrower and not a multiple of the
# head width; S short, odd and at the tile's 128 rows
SHAPES = [(3, 17, 32, 4, 32, 2), (2, 20, 64, 2, 96, 2), (2, 9, 32, 1, 40, 1), (2, 12, 64, 8, 64, 2),
          (2, 5, 32, 2, 24, 1)]
# the pair variant's (causal, 65 <= S <= 128): the second half one token, ragged, full; heads 16, 16 (8 padded),
# 32, 64 wide
PAIR_SHAPES = [(2, 65, 32, 2, 48, 2), (2, 100, 32, 4, 40, 1), (3, 128, 64, 2, 64, 2), (2, 97, 64, 1, 32, 1)]


def _packed(model, cfg, operand_dtype=torch.float64):
    w = per_layer(model, torch.float32 if operand_dtype == torch.float16 else operand_dtype)
    layers = [layer_weights(w, i) for i in range(cfg.num_layers)]
    return hf.pack_weights(layers, (w["final_w"], w["final_b"]), cfg.num_heads, operand_dtype=operand_dtype)


def _case(shape, causal, mask_kind):
    """(config, reference model, x, mask or None, the fp64 forward's output with invalid rows 0)."""
    cfg = cfg_of(shape, causal)
    ref, _ = build_pair(cfg)
    x, mask = make_inputs(cfg, mask_kind)
    return cfg, ref, x, mask, fp64_forward(ref.state_dict(), cfg, x, mask).nan_to_num(0.0)


@pytest.mark.parametrize("mask_kind", MASK_KINDS)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_the_stream_computes_the_reference_forward(shape, causal, mask_kind):
    cfg, ref, x, mask, want = _case(shape, causal, mask_kind)
    got = hf.forward_from_stream(x.double(), _packed(ref, cfg), num_heads=cfg.num_heads, causal=causal, eps=EPS,
                                 mask=mask)
    assert (got - want).abs().max().item() < 1e-12


@pytest.mark.parametrize("mask_kind", MASK_KINDS)
@pytest.mark.parametrize("shape", PAIR_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_the_pair_order_computes_the_reference_forward(shape, mask_kind):
    """Two halves of 64 rows, the first against its own keys and 64 zero keys, the second against the first's
    k and v beside its own: the causal forward exactly."""
    cfg, ref, x, mask, want = _case(shape, True, mask_kind)
    got = hf.forward_from_stream(x.double(), _packed(ref, cfg), num_heads=cfg.num_heads, causal=True, mask=mask,
                                 pair=True, eps=EPS)
    assert (got - want).abs().max().item() < 1e-12


def test_duo_limits_are_named_in_one_place():
    """The warpgroup duo: causal, 65 to 128 tokens, heads up to DUO_MAX_HEAD_DIM wide, not with the pair; its
    k, v double buffers and both halves' vectors counted in the ring's shared memory."""
    assert hf.why_unsupported(128, 128, 4, 128, duo=True) is None
    assert "causal" in hf.why_unsupported(128, 128, 4, 128, causal=False, duo=True)
    assert "seq_len in [65, 128]" in hf.why_unsupported(64, 128, 4, 128, duo=True)
    assert "up to 64 wide" in hf.why_unsupported(128, 128, 1, 128, duo=True)
    assert "not both" in hf.why_unsupported(128, 128, 4, 128, duo=True, pair=True)
    duo, one = hf.launch_config(128, 128, 2, 128, duo=True), hf.launch_config(128, 128, 2, 128)
    assert duo["S_PAD"] == hf.PAIR_ROWS and duo["num_warps"] == 4 and duo["DUO"] and not one["DUO"]
    ring = duo["NUM_SLOTS"] * duo["HD"] * 128 * 2  # [HD, d] fp16 tiles
    assert ring + 2 * (4 * 128 * duo["HD"] + 8 * duo["V_PAD"]) <= hf.SMEM_BYTES
    assert duo["NUM_SLOTS"] % duo["RING_GROUPS"] == 0 and duo["NUM_SLOTS"] <= one["NUM_SLOTS"]


def test_pair_limits_are_named_in_one_place():
    assert "causal" in hf.why_unsupported(128, 128, 4, 128, causal=False, pair=True)
    for s in (64, 1, 129):
        assert "seq_len in [65, 128]" in hf.why_unsupported(s, 128, 4, 128, pair=True)
    assert hf.why_unsupported(65, 128, 4, 128, pair=True) is None
    assert hf.why_unsupported(64, 128, 4, 128) is None  # the default serves it
    cfg, ref, x, _, _ = _case((1, 64, 32, 2, 32, 1), True, "none")
    with pytest.raises(ValueError, match="seq_len in"):
        hf.forward_from_stream(x.double(), _packed(ref, cfg), num_heads=2, causal=True, pair=True, eps=EPS)
    with pytest.raises(ValueError, match="causal"):  # before any device check
        hf.hopper_forward(x, _packed(ref, cfg, torch.float16), num_heads=2, causal=False, pair=True, eps=EPS)


@pytest.mark.parametrize("args", [(128, 128, 4, 128), (128, 128, 1, 128), (128, 128, 2, 128), (65, 32, 4, 32)])
def test_the_pair_launch_is_two_warpgroups_of_the_same_shared_memory(args):
    """A program of a pair: 64 rows, 4 warps, scoring 128 keys: k and v of 128 rows, so the ring of the 128-row
    launch."""
    one, pair = hf.launch_config(*args), hf.launch_config(*args, pair=True)
    assert pair["S_PAD"] == hf.PAIR_ROWS == 64 and pair["num_warps"] == 4 and pair["PAIR"]
    assert {k: v for k, v in pair.items() if k not in ("S_PAD", "num_warps", "PAIR")} == \
        {k: v for k, v in one.items() if k not in ("S_PAD", "num_warps", "PAIR")}
    assert one["S_PAD"] == 128 and not one["PAIR"]
    scratch = hf.pair_scratch(3, 4, args[2], pair["HD"], "cpu")
    assert scratch["kv"].shape == (3, 4, args[2], 2, 64, pair["HD"]) and scratch["kv"].dtype == torch.float16
    assert scratch["flags"].dtype == torch.int32 and not scratch["flags"].any()


def test_padding_is_zero_and_the_stream_is_tile_ordered():
    cfg = cfg_of((1, 4, 32, 4, 40, 2))  # head_dim 8 -> 16, ffn 40 -> 3 chunks of 16
    ref, _ = build_pair(cfg)
    w = _packed(ref, cfg)
    hd = hf.head_dim_padded(8)
    tiles = w["stream"].view(2, -1, hd, 32)
    assert hd == 16 and tiles.shape[1] == hf.stream_tiles(4, 40, hd) == 4 * 4 + 2 * 3
    assert torch.equal(tiles[:, :16, 8:], torch.zeros_like(tiles[:, :16, 8:]))  # padded head lanes
    assert torch.equal(tiles[:, -2:, 8:], torch.zeros_like(tiles[:, -2:, 8:]))  # the FFN's last chunk: 8 of 16 real
    layer1_k_head2 = ref.layers[1].attention.k_proj.weight.double()[16:24]
    assert torch.equal(tiles[1, 4 * 2 + 1, :8], layer1_k_head2)
    assert torch.equal(w["q_b"].view(2, 4, hd)[..., 8:], torch.zeros(2, 4, 8, dtype=torch.float32))
    # the kernel's vectors: each layer's in VECTOR_ORDER at the offsets the kernel reads (6 of d, then q_b, in_b)
    width = 6 * 32 + 4 * hd + 3 * hd
    assert w["vecs"].shape == (2, hf.launch_config(4, 32, 4, 40)["V_PAD"]) and w["vecs"].shape[1] >= width
    assert torch.equal(w["vecs"][:, 4 * 32:5 * 32], w["o_b"].float())
    assert torch.equal(w["vecs"][:, 6 * 32:6 * 32 + 4 * hd], w["q_b"])
    assert torch.equal(w["vecs"][:, 6 * 32 + 4 * hd:width], w["in_b"])
    assert not w["vecs"][:, width:].any()


@pytest.mark.parametrize("operand_dtype", [torch.float16, torch.float64], ids=["fp16", "fp64"])
@pytest.mark.parametrize("shape", SHAPES + PAIR_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_the_packers_size_is_what_it_packs_and_what_the_route_counts(shape, operand_dtype):
    """packed_bytes states pack_weights' layout (padded heads, FFN chunks, `vecs`); pair_scratch_bytes states
    pair_scratch's; route `hopper`'s working set is the two, as the model holds them."""
    cfg = cfg_of(shape)
    ref, _ = build_pair(cfg)
    w = _packed(ref, cfg, operand_dtype)
    args = (cfg.num_layers, cfg.d_model, cfg.num_heads, cfg.ffn_dim)
    assert hf.packed_bytes(*args, operand_dtype=operand_dtype) == sum(t.nbytes for t in w.values())
    hd = hf.head_dim_padded(cfg.head_dim)
    scratch = hf.pair_scratch(cfg.batch_size, cfg.num_layers, cfg.num_heads, hd, "cpu")
    assert hf.pair_scratch_bytes(cfg.batch_size, cfg.num_layers, cfg.num_heads, hd) == \
        sum(t.nbytes for t in scratch.values())
    held = sum(t.nbytes for t in route_hopper.packed(ref, torch.float16).values())
    for pair in (False, True):
        route = Route("hopper", "fp16", "test", pair=pair)
        assert route_hopper.working_set(cfg, torch.float16, route) == held + pair * sum(
            t.nbytes for t in scratch.values())


def test_the_route_prepares_its_launch_on_the_first_call_and_takes_it_after():
    """Route hopper with a prepared launch: the runner's first call prepares its signature's launch (with the
    model's eps and the route's variant) and returns its output; later calls take that launch."""
    made = []

    class Prepared:
        def __init__(self, x, weights, **keywords):
            made.append(keywords)

        @staticmethod
        def serves(x, mask):
            return True

        def __call__(self, x, mask):
            return x + 1

    runner = object.__new__(route_hopper.HopperForward)  # its kernel's parts replaced: no Hopper needed
    runner.route = Route("hopper", "fp16", "test", eager=True, prepared_launch=True, duo=True)
    runner.prepared_launch, runner.hopper_forward = Prepared, None
    runner.weights, runner.desc, runner.hd, runner.scratch, runner.launch = {}, None, 16, None, None
    model, x = types.SimpleNamespace(config=cfg_of((2, 8, 32, 2, 32, 1))), torch.zeros(2, 8, 32)
    assert torch.equal(runner(model, x, None), x + 1) and torch.equal(runner(model, x, None), x + 1)
    assert len(made) == 1 and made[0]["eps"] == EPS and made[0]["direct"] is False and made[0]["duo"] is True


def test_the_kernels_gelu_is_exact_gelu_to_its_erf():
    t = torch.linspace(-12, 12, 200001, dtype=torch.float64)
    err = (hf.gelu(t) - torch.nn.functional.gelu(t)).abs()
    assert (err <= 1.5e-7 * 0.5 * t.abs() + 1e-15).all(), err.max()  # GELU = x (1 + erf) / 2
    assert torch.equal(hf.gelu(torch.zeros(3, dtype=torch.float64)), torch.zeros(3, dtype=torch.float64))


@pytest.mark.parametrize("args, words", [
    ((129, 128, 4, 128), "seq_len <= 128"),
    ((64, 96, 4, 96), "d_model in"),
    ((64, 256, 4, 256), "d_model in"),
    ((64, 32, 3, 32), "d_model % num_heads"),
])
def test_limits_are_named(args, words):
    why = hf.why_unsupported(*args)
    assert why is not None and words in why


@pytest.mark.parametrize("args", [(128, 128, 4, 128), (128, 128, 1, 128), (32, 128, 16, 128), (128, 32, 4, 32),
                                  (64, 64, 2, 4096)])
def test_the_launch_fits_shared_memory(args):
    assert hf.why_unsupported(*args) is None
    cfg = hf.launch_config(*args)
    S, d = cfg["S_PAD"], args[1]
    ring = cfg["NUM_SLOTS"] * cfg["HD"] * d * 2
    assert 2 <= cfg["NUM_SLOTS"] <= hf.MAX_SLOTS and ring + 4 * S * cfg["HD"] + 8 * cfg["V_PAD"] <= hf.SMEM_BYTES
    # the ring's barriers in RING_GROUPS allocations, a layer's tiles a multiple of them
    assert cfg["NUM_SLOTS"] % cfg["RING_GROUPS"] == 0
    assert hf.stream_tiles(args[2], args[3], cfg["HD"]) % cfg["RING_GROUPS"] == 0
    assert cfg["num_warps"] * 16 == S >= args[0]


COMPILE = textwrap.dedent('''
    from benchmarks.attention_registers import usage
    from benchmarks.hopper_sass import TMA_LOAD, compile_hopper
    from shapewise.kernels import hopper_forward as hf

    for S, d, H, F, causal, masked, pair, producer, duo in (
            (128, 128, 4, 128, True, True, False, False, False), (128, 128, 1, 128, True, False, False, False, False),
            (32, 128, 16, 128, False, True, False, False, False), (128, 32, 4, 32, True, True, False, False, False),
            # the pair variant at official rows 1, 9, 10 (4, 1, 2 heads)
            (128, 128, 4, 128, True, True, True, False, False), (128, 128, 1, 128, True, True, True, False, False),
            (128, 128, 2, 128, True, True, True, False, False),
            # a loader warp: rows 1 and 12, and with the pair row 10
            (128, 128, 4, 128, True, True, False, True, False), (32, 128, 4, 128, True, True, False, True, False),
            (128, 128, 2, 128, True, True, True, True, False),
            # the warpgroup duo at rows 1 and 7
            (128, 128, 4, 128, True, True, False, False, True), (128, 32, 4, 32, True, True, False, False, True)):
        k, cfg = compile_hopper(S, d, H, F, causal, masked, pair, producer, duo)
        ptx = k.asm["ptx"]
        assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx, (S, d, H)
        assert k.metadata.shared <= 227 * 1024, (S, d, H, k.metadata.shared)
        loads = k.asm["ttgir"].count(TMA_LOAD)
        if duo:  # two halves of 4 warps, each with its own partition barrier
            flat = " ".join(ptx.split())
            assert "bar.sync 0, 128;" in flat and "bar.sync 2, 128;" in flat, (S, d, H)
            print("duo", S, d, H, F)
        if producer or duo:  # the loader's loop over the program's tiles, a load per allocation of the ring's barriers
            assert loads == cfg["RING_GROUPS"] and "setmaxnreg" in ptx, (S, d, H, loads)
            assert usage(k, cfg["num_warps"])["spill_store_bytes"] == 0, (S, d, H)
        else:  # one TMA load per ring slot to start, then one per tile in the code of a layer (the head loop's
            # body once: 4 tiles; the out-projection's; each FFN chunk's two, unrolled), each handing back a
            # consumed slot: no refill is a loop over a tile count carried from sequence to sequence
            assert loads == cfg["NUM_SLOTS"] + 4 + 1 + 2 * cfg["F_CHUNKS"], (S, d, H, loads)
        if pair:  # the pair's protocol: release exchange, acquire load (GPU scope), the first half's tiles by cp.async
            assert "atom.global.gpu.release.exch" in ptx and "ld.global.gpu.acquire" in ptx, (S, d, H)
            assert "cp.async.cg.shared.global" in ptx and "cp.async.wait_group" in ptx, (S, d, H)
            use = usage(k, cfg["num_warps"])
            assert cfg["num_warps"] == 4 and use["spill_store_bytes"] == 0, (S, d, H, use)
            print("pair", S, d, H, F, use)
        print("compiled", S, d, H, F, k.metadata.shared)
''')


def _built_offline(script):
    """`script`'s stdout, run in a process of its own outside the interpreter (Triton builds for sm_90 there), the
    checkout's package importable; the process must succeed."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "workflow"), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


MASK_INSTRUCTIONS = textwrap.dedent('''
    from benchmarks.hopper_sass import compile_hopper, sass_opcodes

    for d, H, F in ((128, 4, 128), (32, 4, 32), (128, 2, 128)):  # the duo at official rows 1, 5, 6; 7; 10
        counts = [sum(sass_opcodes(compile_hopper(128, d, H, F, True, masked, duo=True)[0]).values())
                  for masked in (True, False)]
        print("instructions", d, H, F, *counts)
''')


@pytest.mark.skipif(hf.gluon is None, reason="this Triton has no Gluon")
def test_the_official_calls_mask_adds_no_instructions_to_the_duo():
    """The official call passes a mask: the duo's build with one has at most 1 % more SASS instructions than without
    (the keys' mask as positions, one compare a score: docs/decisions.md#hopper-mask-positions; loaded as booleans
    it had 6-11 % more)."""
    rows = [line.split()[1:] for line in _built_offline(MASK_INSTRUCTIONS).splitlines()
            if line.startswith("instructions")]
    assert len(rows) == 3
    for d, H, F, masked, unmasked in rows:
        assert int(masked) <= 1.01 * int(unmasked), (d, H, F, masked, unmasked)


class _FakeCompiled:
    """What PreparedLaunch takes from Triton's compiled kernel: `run` (records each launch), its handles."""
    function, packed_metadata = "function", "metadata"

    def __init__(self):
        self.launches = []

    def run(self, *launch):
        self.launches.append(launch)

    def launch_metadata(self, grid, stream, *values):
        return ("metadata of", grid, stream, len(values))


class _FakeKernel:
    def __init__(self):
        self.arg_names = hf._hopper_forward_fwd.arg_names
        self.compiled, self.warmed = _FakeCompiled(), []

    def warmup(self, grid, **args):
        self.warmed.append((grid, args))
        return self.compiled


def _on_a_fake_hopper(monkeypatch, kernel):
    """`kernel` as the Hopper forward's kernel, on a CPU posing as an H100 (132 SMs, current stream 1234)."""
    monkeypatch.setattr(hf, "_hopper_forward_fwd", kernel)
    monkeypatch.setattr(hf, "_on_hopper", lambda device: True)
    monkeypatch.setattr(hf.torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(hf.torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(
        multi_processor_count=132))
    monkeypatch.setattr(hf, "driver", types.SimpleNamespace(active=types.SimpleNamespace(
        get_current_stream=lambda index: 1234)))


@pytest.mark.skipif(hf.gluon is None, reason="this Triton has no Gluon")
@pytest.mark.parametrize("pair", [False, True])
@pytest.mark.parametrize("with_mask", [True, False])
def test_a_prepared_launch_passes_each_calls_tensors_in_the_kernels_order(monkeypatch, pair, with_mask):
    """The launch assembled once (every kernel parameter, in order, constexprs included) takes each call's x,
    mask and a new output in their places (KV, Flags and Mask stand in for the output where unused); the first
    call's tensors are not held; a profiler's launch hooks are honoured."""
    cfg, ref, x, mask, _ = _case((2, 100 if pair else 40, 32, 2, 48, 2), True, "holes")
    mask = mask if with_mask else None
    packed = _packed(ref, cfg, torch.float16)
    fake = _FakeKernel()
    _on_a_fake_hopper(monkeypatch, fake)
    scratch = hf.pair_scratch(2, 2, 2, 16, "cpu") if pair else None
    launch = hf.PreparedLaunch(x, packed, num_heads=2, causal=True, mask=mask, programs=4, pair=pair,
                               scratch=scratch, eps=EPS)
    (grid, args), = fake.warmed
    assert grid == (4,) and list(args) == fake.arg_names and args["PAIR"] is pair
    assert args["HAS_MASK"] is with_mask and args["num_warps"] == hf.launch_config(cfg.seq_len, 32, 2, 48, pair)[
        "num_warps"]
    assert not any(v is x or v is args["Y"] for v in launch.values)  # the first call's tensors are not held
    names = fake.arg_names
    for call in range(2):
        x2 = torch.randn_like(x)
        m2 = None if mask is None else mask.clone()
        y = launch(x2, m2)
        (programs, gy, gz, stream, function, meta, launch_meta, enter, leave, *values) = fake.compiled.launches[-1]
        assert (programs, gy, gz, stream, function, meta) == (4, 1, 1, 1234, "function", "metadata")
        assert launch_meta is None and enter is None and leave is None  # Triton's empty hook chains
        assert len(values) == len(names) and values[names.index("X")] is x2 and values[names.index("Y")] is y
        assert y.shape == x.shape and y.dtype == x.dtype
        assert values[names.index("Mask")] is (m2 if with_mask else y)
        if pair:
            assert values[names.index("KV")] is scratch["kv"] and values[names.index("Flags")] is scratch["flags"]
        else:
            assert values[names.index("KV")] is y and values[names.index("Flags")] is y
        for name in ("w_desc", "VEC", "batch", "seq_len", "stride_xb", "S_PAD", "IS_CAUSAL"):
            assert values[names.index(name)] is args[name], name
    assert y.data_ptr() != launch(x2, m2).data_ptr()  # a new output each call
    monkeypatch.setattr(hf.knobs.runtime, "launch_enter_hook", hook := lambda *a: None)
    launch(x2, m2)
    assert fake.compiled.launches[-1][6:8] == (("metadata of", (4,), 1234, len(names)), hook)
    assert hf.PreparedLaunch.serves(x2, m2) and not hf.PreparedLaunch.serves(x2.transpose(0, 1), m2)
    assert not hf.PreparedLaunch.serves(torch.randn(2 * x.numel() + 1)[1:x.numel() + 1].view(x.shape), m2)
    with pytest.raises(ValueError, match="16-byte aligned"):
        hf.PreparedLaunch(x.transpose(0, 1), packed, num_heads=2, causal=True, mask=mask, eps=EPS)


class _CLaunch:
    """Triton's C launch function: a callable without Python code, recording its arguments."""

    def __init__(self):
        self.calls = []

    def __call__(self, *args):
        self.calls.append(args)


class _FakeLauncher:
    """Triton 3.6's CudaLauncher as PreparedLaunch reads it: no scratch, its flags, `launch` the descriptor
    wrapper (a closure over the C function `launcher`), and the call the JIT path makes."""
    global_scratch_size = profile_scratch_size = 0
    launch_cooperative_grid, launch_pdl = False, True

    def __init__(self):
        self.c_launch, self.calls = _CLaunch(), []
        launcher = self.c_launch

        def launch(*args):  # what wrap_handle_tensordesc returns: expands descriptors, then the C function
            return launcher(*args)

        self.launch = launch

    def __call__(self, *args):
        self.calls.append(args)


@pytest.mark.skipif(hf.gluon is None, reason="this Triton has no Gluon")
@pytest.mark.parametrize("pair", [False, True])
@pytest.mark.parametrize("with_mask", [True, False])
def test_a_prepared_launch_hands_the_c_launcher_addresses_and_a_descriptor_encoded_once(monkeypatch, pair,
                                                                                        with_mask):
    """The C launcher gets the argument list Triton's wrapper would expand, built once: the weight descriptor
    encoded at preparation only, every other tensor as its address; per call x's, the mask's and a new output's
    addresses in their places. With a profiler's launch hook set, the launch goes through `run` as a JIT launch."""
    cfg, ref, x, mask, _ = _case((2, 100 if pair else 40, 32, 2, 48, 2), True, "holes")
    mask = mask if with_mask else None
    packed = _packed(ref, cfg, torch.float16)
    fake = _FakeKernel()
    launcher = fake.compiled.run = _FakeLauncher()
    fake.compiled.metadata = types.SimpleNamespace(tensordesc_meta=[{"swizzle": 128}])
    encoded = []
    monkeypatch.setattr(hf, "make_tensordesc_arg", lambda desc, meta: (encoded.append((desc, meta)), [
        "encoded map", *desc.shape, *desc.strides])[1])
    _on_a_fake_hopper(monkeypatch, fake)
    scratch = hf.pair_scratch(2, 2, 2, 16, "cpu") if pair else None
    launch = hf.PreparedLaunch(x, packed, num_heads=2, causal=True, mask=mask, programs=4, pair=pair,
                               scratch=scratch, eps=EPS)
    (_, args), = fake.warmed
    names = fake.arg_names
    assert launch.direct is not None and len(encoded) == 1 and encoded[0][1] == {"swizzle": 128}
    desc = args["w_desc"]
    expanded = []  # the kernel's parameters in order, the descriptor as its encoding, tensors as addresses
    for name in names:
        v = args[name]
        expanded.extend(["encoded map", *desc.shape, *desc.strides] if v is desc else
                        [v.data_ptr() if isinstance(v, torch.Tensor) else v])
    at = {n: names.index(n) for n in ("X", "Y", "Mask", "KV", "Flags")}
    shift = len(desc.shape) + len(desc.strides)  # parameters after the descriptor move by its expansion
    place = {n: i + (shift if i > names.index("w_desc") else 0) for n, i in at.items()}
    for call in range(2):
        x2 = torch.randn_like(x)
        m2 = None if mask is None else mask.clone()
        y = launch(x2, m2)
        head, values = launcher.c_launch.calls[-1][:13], launcher.c_launch.calls[-1][13:]
        # grid, stream, function, cooperative and PDL flags, no scratch, metadata, no launch metadata or hooks
        assert head == (4, 1, 1, 1234, "function", False, True, None, None, "metadata", None, None, None)
        assert len(values) == len(expanded)
        assert values[place["X"]] == x2.data_ptr() and values[place["Y"]] == y.data_ptr()
        assert values[place["Mask"]] == (m2.data_ptr() if with_mask else y.data_ptr())
        others = ("KV", "Flags") if pair else ()
        for name in others:
            assert values[place[name]] == scratch[name.lower()].data_ptr(), name
        per_call = {place[n] for n in ("X", "Y", "Mask") + (() if pair else ("KV", "Flags"))}
        assert all(v == expanded[i] for i, v in enumerate(values) if i not in per_call)
    assert len(encoded) == 1 and launcher.calls == []  # no descriptor encoded, no JIT path, per call
    monkeypatch.setattr(hf.knobs.runtime, "launch_enter_hook", lambda *a: None)
    launch(x2, m2)
    assert len(launcher.calls) == 1 and len(launcher.c_launch.calls) == 2


@pytest.mark.skipif(hf.gluon is None, reason="this Triton has no Gluon")
def test_the_kernel_builds_for_sm90_with_wgmma_and_tma():
    stdout = _built_offline(COMPILE)
    assert stdout.count("compiled") == 12 and stdout.count("pair") == 4 and stdout.count("duo") == 2


# ----------------------------------------------------------------------------------------------
# On an H200 (sm_90)
# ----------------------------------------------------------------------------------------------
ON_HOPPER = CUDA and torch.cuda.get_device_capability()[0] == 9
needs_hopper = pytest.mark.skipif(not ON_HOPPER, reason="needs an sm_90 GPU")

GPU_SHAPES = [(3, 128, 128, 4, 128, 2), (2, 100, 128, 1, 128, 2), (2, 128, 128, 2, 128, 1),
              (2, 128, 128, 16, 128, 1), (3, 32, 128, 4, 128, 2), (2, 128, 32, 4, 32, 2), (2, 64, 64, 2, 256, 1),
              (2, 7, 64, 4, 100, 1)]


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("mask_kind", MASK_KINDS)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_kernel_matches_fp64(shape, causal, mask_kind):
    cfg, ref, x, mask, want = _case(shape, causal, mask_kind)
    packed = {k: v.cuda() for k, v in _packed(ref, cfg, torch.float16).items()}
    xc, mc = x.cuda(), None if mask is None else mask.cuda()
    out = torch.full_like(xc, float("nan"))  # poisoned: every element must be written
    got = hf.hopper_forward(xc, packed, num_heads=cfg.num_heads, causal=causal, mask=mc, out=out, eps=EPS)
    check_official(want.float(), got.cpu(), f"hopper_forward {shape} causal={causal} {mask_kind}")
    rel = ((got.cpu().double() - want).norm() / want.norm()).item()
    assert rel < 3e-3, rel


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("mask_kind", ["all_true", "holes", "one_empty"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("shape", [(3, 128, 128, 4, 128, 2), (2, 128, 32, 4, 32, 2), (3, 32, 128, 8, 128, 2),
                                   (2, 100, 128, 1, 128, 2)], ids=lambda s: "x".join(map(str, s)))
def test_a_loader_warp_gives_the_same_output(shape, causal, mask_kind):
    """`producer`: a loader warp fills the weight ring, the math warps hand slots back; bit for bit the default's
    output (the same math in the same order), across layers and sequences of one program."""
    cfg, ref, x, mask, want = _case(shape, causal, mask_kind)
    packed = {k: v.cuda() for k, v in _packed(ref, cfg, torch.float16).items()}
    xc, mc = x.cuda(), None if mask is None else mask.cuda()
    for programs in (None, 1):
        got = hf.hopper_forward(xc, packed, num_heads=cfg.num_heads, causal=causal, mask=mc,
                                out=torch.full_like(xc, float("nan")), programs=programs, producer=True, eps=EPS)
        check_official(want.float(), got.cpu(), f"producer {shape} causal={causal} {mask_kind} {programs}")
        plain = hf.hopper_forward(xc, packed, num_heads=cfg.num_heads, causal=causal, mask=mc, programs=programs,
                                  eps=EPS)
        assert torch.equal(got, plain)


# the pair variant on an H200: the CPU's pair shapes and official rows 1, 9, 10 (64 sequences, 4/1/2 heads)
PAIR_GPU_SHAPES = PAIR_SHAPES + [(64, 128, 128, 4, 128, 4), (64, 128, 128, 1, 128, 4), (64, 128, 128, 2, 128, 4)]


def _pair_case(shape, mask_kind):
    cfg, ref, x, mask, want = _case(shape, True, mask_kind)
    packed = {k: v.cuda() for k, v in _packed(ref, cfg, torch.float16).items()}
    scratch = hf.pair_scratch(cfg.batch_size, cfg.num_layers, cfg.num_heads, hf.head_dim_padded(cfg.head_dim), "cuda")
    return cfg, x.cuda(), None if mask is None else mask.cuda(), want, packed, scratch


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("mask_kind", MASK_KINDS)
@pytest.mark.parametrize("producer", [False, True])
@pytest.mark.parametrize("shape", PAIR_GPU_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_pair_matches_fp64(shape, mask_kind, producer):
    """Two programs a sequence against fp64 (with `producer`, each with a loader warp), launched twice on one
    scratch: each launch leaves every flag at 0, so the second reads no count of the first."""
    cfg, xc, mc, want, packed, scratch = _pair_case(shape, mask_kind)
    for launch in range(2):
        out = torch.full_like(xc, float("nan"))  # poisoned: every element must be written
        got = hf.hopper_forward(xc, packed, num_heads=cfg.num_heads, causal=True, mask=mc, out=out, pair=True,
                                producer=producer, scratch=scratch, eps=EPS)
        check_official(want.float(), got.cpu(), f"pair {shape} {mask_kind} launch {launch}")
        rel = ((got.cpu().double() - want).norm() / want.norm()).item()
        assert rel < 3e-3, rel
        assert not scratch["flags"].any()


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("mask_kind", MASK_KINDS)
@pytest.mark.parametrize("shape", [s for s in PAIR_GPU_SHAPES if s[2] // s[3] <= hf.DUO_MAX_HEAD_DIM],
                         ids=lambda s: "x".join(map(str, s)))
def test_duo_matches_fp64_and_the_pair(shape, mask_kind):
    """A sequence's two halves as two warpgroups of one program against fp64, one program per sequence and one
    for all: bit for bit the pair's output (the same math; the first half's masked keys add exact zeros)."""
    cfg, xc, mc, want, packed, scratch = _pair_case(shape, mask_kind)
    pair = hf.hopper_forward(xc, packed, num_heads=cfg.num_heads, causal=True, mask=mc, pair=True, scratch=scratch,
                             eps=EPS)
    for programs in (None, 1):
        out = torch.full_like(xc, float("nan"))  # poisoned: every element must be written
        got = hf.hopper_forward(xc, packed, num_heads=cfg.num_heads, causal=True, mask=mc, out=out, duo=True,
                                programs=programs, eps=EPS)
        check_official(want.float(), got.cpu(), f"duo {shape} {mask_kind} {programs}")
        assert torch.equal(got, pair)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("programs", [2, 8, None])
def test_pairs_run_across_sequences_and_launches(programs):
    """More sequences than pairs (3 a pair; 200 on the default pairs, one per two SMs), launch after launch on one
    scratch and in a replayed CUDA graph: the same output bits each time, against fp64."""
    shape = (3 * programs // 2 if programs else 200, 100, 64, 2, 64, 3)
    cfg, xc, mc, want, packed, scratch = _pair_case(shape, "holes")

    def run():
        return hf.hopper_forward(xc, packed, num_heads=2, causal=True, mask=mc, pair=True, scratch=scratch,
                                 programs=programs, eps=EPS)

    first = run()
    check_official(want.float(), first.cpu(), f"pair across sequences, {programs} programs")
    for _ in range(3):
        assert torch.equal(run(), first)
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()  # warm: compiled before capture
        with torch.cuda.graph(graph, stream=stream):
            y = run()
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(3):
        y.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, first) and not scratch["flags"].any()


@pytest.mark.gpu
@needs_hopper
def test_pair_launches_are_pairs_all_resident():
    cfg, xc, mc, want, packed, scratch = _pair_case((2, 100, 64, 2, 64, 1), "none")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for programs in (3, sms + 2):
        with pytest.raises(ValueError, match="pairs, all resident"):
            hf.hopper_forward(xc, packed, num_heads=2, causal=True, pair=True, programs=programs, eps=EPS)
    with pytest.raises(ValueError, match="pair_scratch"):
        hf.hopper_forward(xc, packed, num_heads=2, causal=True, pair=True,
                          scratch={"kv": scratch["kv"][:1], "flags": scratch["flags"]}, eps=EPS)


@pytest.mark.gpu
@needs_hopper
def test_the_ring_runs_across_sequences_of_one_program():
    """More sequences than programs: each program's stream of tiles wraps from one forward to the next."""
    cfg, ref, x, mask, want = _case((37, 50, 64, 2, 64, 3), True, "holes")
    packed = {k: v.cuda() for k, v in _packed(ref, cfg, torch.float16).items()}
    for programs in (1, 5, 36):
        got = hf.hopper_forward(x.cuda(), packed, num_heads=2, causal=True, eps=EPS, mask=mask.cuda(),
                                programs=programs)
        check_official(want.float(), got.cpu(), f"{programs} programs")


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_route_serves_the_official_row_shape_and_sees_weight_edits(dtype):
    cfg = cfg_of((4, 128, 128, 4, 128, 4))
    ref, opt = build_pair(cfg, "hopper")
    ref, opt = ref.cuda().to(dtype), opt.cuda().to(dtype)
    x, mask = make_inputs(cfg, "all_true", dtype)
    x, mask = x.cuda(), mask.cuda()
    with torch.inference_mode():
        y = opt(x, mask)
    assert opt.last_route.name == "hopper" and y.dtype == dtype
    check_official(fp64_forward(ref.state_dict(), cfg, x.cpu().float(), mask.cpu()).float(), y.float().cpu(),
                   f"route hopper {dtype}")
    with torch.no_grad():
        opt.layers[2].ffn_in.weight.mul_(1.5)
        ref.layers[2].ffn_in.weight.mul_(1.5)
    with torch.inference_mode():
        y = opt(x, mask)
    check_official(fp64_forward(ref.state_dict(), cfg, x.cpu().float(), mask.cpu()).float(), y.float().cpu(),
                   "after a weight edit")


def _routed_case(cfg, mask_kind):
    """The reference and the automatically routed model on the same weights, on the GPU, and the case's x, mask."""
    ref, opt = build_pair(cfg, "auto")
    x, mask = make_inputs(cfg, mask_kind)
    return ref.cuda(), opt.cuda(), x.cuda(), None if mask is None else mask.cuda()


def _fp64_on_cpu(ref, cfg, x, mask):
    """The fp64 forward of `ref`'s weights on the CPU, invalid rows 0, as fp32."""
    return fp64_forward(ref.state_dict(), cfg, x.cpu(), None if mask is None else mask.cpu()).nan_to_num(0.0).float()


def _edit_a_weight(ref, opt, cfg, x, mask):
    """Layer 1's FFN-in weight scaled in both models, in place (as a user edits one): the new fp64 forward."""
    with torch.no_grad():
        opt.layers[1].ffn_in.weight.mul_(1.5)
        ref.layers[1].ffn_in.weight.mul_(1.5)
    return _fp64_on_cpu(ref, cfg, x, mask)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("mask_kind", MASK_KINDS)
def test_route_pairs_programs_where_the_policy_says_so(monkeypatch, mask_kind):
    """Policy `hopper.pair_max_batch` covering the batch: the route runs two programs a sequence, captured and
    replayed on one scratch, exact on every mask kind and after a weight edit; the switch off runs one."""
    from shapewise.model import routing

    monkeypatch.setitem(routing.POLICY, "hopper", {**routing.POLICY["hopper"], "pair_max_batch": 64, "min_batch": 1,
                                                   "duo_max_head_dim": None})
    cfg = cfg_of((6, 100, 128, 4, 128, 2))
    ref, opt, x, mask = _routed_case(cfg, mask_kind)
    want = _fp64_on_cpu(ref, cfg, x, mask)
    with torch.inference_mode():
        ys = [opt(x, mask).cpu() for _ in range(4)]  # capture, then replays of the graph that reads x in place
    assert opt.last_route.name == "hopper" and opt.last_route.pair, str(opt.last_route)
    for y in ys:
        check_official(want, y, f"pair route, {mask_kind}")
    want = _edit_a_weight(ref, opt, cfg, x, mask)
    with torch.inference_mode():
        check_official(want, opt(x, mask).cpu(), f"pair route after a weight edit, {mask_kind}")
    _, one = build_pair(cfg, "auto", disable=("hopper_pair",))
    one.load_state_dict(opt.state_dict())
    with torch.inference_mode():
        check_official(want, one.cuda()(x, mask).cpu(), f"hopper_pair off, {mask_kind}")
    assert one.last_route.name == "hopper" and not one.last_route.pair


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("mask_kind", MASK_KINDS)
def test_route_runs_the_duo_where_the_policy_says_so(monkeypatch, mask_kind):
    """Policy `hopper.duo_max_head_dim` covering the heads: the route runs a sequence's halves as two warpgroups,
    exact on every mask kind, call after call and after a weight edit; the switch off runs the pair the policy
    gives without it, bit for bit the same output."""
    from shapewise.model import routing

    monkeypatch.setitem(routing.POLICY, "hopper", {**routing.POLICY["hopper"], "pair_max_batch": 64, "min_batch": 1,
                                                   "duo_max_head_dim": 64})
    cfg = cfg_of((6, 100, 128, 4, 128, 2))
    ref, opt, x, mask = _routed_case(cfg, mask_kind)
    want = _fp64_on_cpu(ref, cfg, x, mask)
    with torch.inference_mode():
        ys = [opt(x, mask).cpu() for _ in range(3)]
    assert opt.last_route.name == "hopper" and opt.last_route.duo and not opt.last_route.pair, str(opt.last_route)
    for y in ys:
        check_official(want, y, f"duo route, {mask_kind}")
    _, paired = build_pair(cfg, "auto", disable=("hopper_duo",))
    paired.load_state_dict(opt.state_dict())
    with torch.inference_mode():
        assert torch.equal(paired.cuda()(x, mask).cpu(), ys[0])
    assert paired.last_route.pair and not paired.last_route.duo, str(paired.last_route)
    want = _edit_a_weight(ref, opt, cfg, x, mask)
    with torch.inference_mode():
        check_official(want, opt(x, mask).cpu(), f"duo route after a weight edit, {mask_kind}")


@pytest.mark.gpu
@needs_hopper
def test_route_launches_eagerly_beyond_the_graph_bound():
    """1040 sequences of 128 x 128 (tokens*d above graph.max_tokens_x_d_model): no graph, a fresh output per call."""
    from shapewise.model import routing

    cfg = cfg_of((1040, 128, 128, 4, 128, 4))
    assert cfg.batch_size * cfg.seq_len * cfg.d_model > routing.POLICY["graph"]["max_tokens_x_d_model"]
    ref, opt = build_pair(cfg, "hopper")
    ref, opt = ref.cuda(), opt.cuda()
    x, mask = make_inputs(cfg, "all_true", torch.float32)
    x, mask = x.cuda(), mask.cuda()
    with torch.inference_mode():
        y, again = opt(x, mask), opt(x, mask)
    assert opt.last_route.name == "hopper" and opt.last_route.eager and opt._graphs.holders == []
    assert y.data_ptr() != again.data_ptr() and torch.equal(y, again)
    head = cfg_of((4, 128, 128, 4, 128, 4))  # sequences are independent: the first four against fp64
    check_official(fp64_forward(ref.state_dict(), head, x[:4].cpu(), mask[:4].cpu()).float(), y[:4].cpu(),
                   "route hopper, eager")


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("mask_kind", MASK_KINDS)
@pytest.mark.parametrize("pair, duo", [(False, False), (True, False), (False, True)])
def test_a_prepared_launch_equals_the_jit_launch(mask_kind, pair, duo):
    """Call after call with new inputs, and captured in a CUDA graph: the bits of hopper_forward's output."""
    cfg, ref, x, mask, want = _case((5, 100, 64, 2, 64, 2), True, mask_kind)
    packed = {k: v.cuda() for k, v in _packed(ref, cfg, torch.float16).items()}
    scratch = hf.pair_scratch(5, 2, 2, 32, "cuda") if pair else None
    mc = None if mask is None else mask.cuda()
    keywords = dict(num_heads=2, causal=True, eps=EPS, pair=pair, duo=duo, scratch=scratch)
    launch = hf.PreparedLaunch(x.cuda(), packed, mask=mc, **keywords)
    assert launch.direct is not None  # this Triton's C launcher reached (kernels.hopper_forward._c_launcher)
    for trial in range(3):
        xc = x.cuda() if trial == 0 else torch.randn_like(x.cuda())
        got = launch(xc, mc)
        assert torch.equal(got, hf.hopper_forward(xc, packed, mask=mc, **keywords)), trial
        if trial == 0:
            check_official(want.float(), got.cpu(), f"prepared launch, {mask_kind}, pair={pair}, duo={duo}")
    xc = x.cuda()
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        y = launch(xc, mc)
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    assert torch.equal(y, hf.hopper_forward(xc, packed, mask=mc, **keywords))


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("direct", [False, True])
def test_route_launches_eagerly_where_the_policy_says_so(monkeypatch, direct):
    """Policy `hopper.eager_min_batch` covering the batch: no graph, the signature's prepared launch (through the C
    launcher where `hopper.direct_launch` says so), a new output per call; an input at an address the kernel was
    not specialized on runs the JIT launch; a weight edit is seen."""
    from shapewise.model import routing

    monkeypatch.setitem(routing.POLICY, "hopper", {**routing.POLICY["hopper"], "eager_min_batch": 1, "min_batch": 1,
                                                   "direct_launch": direct})
    cfg = cfg_of((6, 128, 128, 4, 128, 2))
    ref, opt, x, mask = _routed_case(cfg, "holes")
    want = _fp64_on_cpu(ref, cfg, x, mask)
    with torch.inference_mode():
        ys = [opt(x, mask) for _ in range(3)]
    assert opt.last_route.name == "hopper" and opt.last_route.eager and opt._graphs.holders == []
    runner = opt._paths[(x.shape, x.dtype, x.device, False)]
    assert runner.launch is not None and len({y.data_ptr() for y in ys}) == 3
    assert (runner.launch.direct is not None) == direct and opt.last_route.direct_launch == direct
    for y in ys:
        check_official(want, y.cpu(), "route hopper, prepared launch")
    shifted = torch.empty(x.numel() + 1, device="cuda")[1:].view(x.shape)  # 4 bytes past an aligned address
    shifted.copy_(x)
    with torch.inference_mode():
        assert torch.equal(opt(shifted, mask), ys[0])
    want = _edit_a_weight(ref, opt, cfg, x, mask)
    with torch.inference_mode():
        check_official(want, opt(x, mask).cpu(), "prepared launch after a weight edit")


def test_the_routes_weight_stream_is_refreshed_in_place_after_an_edit():
    """The route's captured graphs and TMA descriptor keep the stream's address: an edit rewrites it in place."""
    from shapewise.model import route_hopper

    cfg = cfg_of((2, 9, 32, 2, 48, 2))
    _, opt = build_pair(cfg)
    table = opt._weights.table(opt, "fp16", route_hopper.packed)
    stream, ptr = table["stream"], table["stream"].data_ptr()
    hd = hf.head_dim_padded(cfg.head_dim)
    tiles = stream.view(2, -1, hd, 32)
    with torch.no_grad():
        opt.layers[1].attention.v_proj.weight.mul_(-2.0)
    opt._weights.refresh(opt)
    assert table["stream"].data_ptr() == ptr
    want = opt.layers[1].attention.v_proj.weight[16:32].to(torch.float16)  # head 1's rows of W_v
    assert torch.equal(tiles[1, 4 * 1 + 2, :16], want)
    with torch.no_grad():  # the v bias lives in the out-projection's bias: an edit of either reaches it
        opt.layers[1].attention.v_proj.bias.add_(0.5)
    opt._weights.refresh(opt)
    att = opt.layers[1].attention
    folded = (att.out_proj.bias.double() + att.out_proj.weight.double() @ att.v_proj.bias.double()).float()
    assert torch.allclose(table["o_b"][1], folded, rtol=0, atol=1e-6)
    one = Route("hopper", "fp16", "the one-program route")
    assert route_hopper.working_set(cfg, torch.float32, one) >= stream.numel() * 2
