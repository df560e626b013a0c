"""kernels/attention_hopper.py: its limits and launch checks (CPU), the polynomial exp2 that EXP2_POLY moves off
MUFU (CPU), its sm_90a build at every launch the launcher and the row-14 sweep use (offline, no GPU: a cubin, no
register spills, no serialized wgmma, shared memory within the H200's 227 KB), and on a Hopper GPU the kernel
against an fp64 attention on odd shapes, q, k, v packed as the model passes them, contiguous, or with heads not D
apart (copied by the launcher), and the triton route running it where the policy says so."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from shapewise.kernels import attention_hopper as ah

ROOT = Path(__file__).resolve().parent.parent
CUDA = torch.cuda.is_available()
ON_HOPPER = CUDA and torch.cuda.get_device_capability()[0] == 9
needs_hopper = pytest.mark.skipif(not ON_HOPPER, reason="needs an sm_90 GPU")
needs_gluon = pytest.mark.skipif(ah.gluon is None, reason="this Triton has no Gluon")

# output dtype -> (atol, rtol), the project's rule (|diff| <= atol or <= rtol |expected|), as tests/test_attention.py
# keys fp16: fp16 operands and probabilities round to 11 bits (~5e-4 relative each), the output too
TOL = {torch.float16: (4e-3, 4e-3)}

# launches beside the defaults that the row-14 sweep times: three consumers at 64 keys a slot, ping-pong off, two
# and four slots (compiled offline with the defaults, run on the GPU against fp64)
VARIANTS = [dict(CONSUMERS=3, BLOCK_N=64, STAGES=4), dict(PINGPONG=False), dict(STAGES=2), dict(STAGES=4),
            dict(BLOCK_N=64)]
# the default launch with a quarter and a half of each score block's exp2 by the polynomial (the sweep's too)
POLY_VARIANTS = [dict(EXP2_POLY=32), dict(EXP2_POLY=64)]


# ----------------------------------------------------------------------------------------------
# CPU: limits and launch checks
# ----------------------------------------------------------------------------------------------
@needs_gluon
@pytest.mark.parametrize("args, words", [
    ((32, torch.float16), "head_dim in"),
    ((256, torch.float16), "head_dim in"),
    ((64, torch.bfloat16), "fp16"),
    ((64, torch.float32), "fp16"),
    ((64, torch.float16, "cpu"), "CUDA device"),
])
def test_limits_are_named(args, words):
    why = ah.why_unsupported(*args)
    assert why is not None and words in why, why


@needs_gluon
@pytest.mark.parametrize("head_dim", ah.HEAD_DIMS)
def test_the_defaults_fit_shared_memory(head_dim):
    assert ah.why_unsupported(head_dim) is None
    cfg = ah.check_config(head_dim, None)
    assert ah.shared_bytes(head_dim, cfg) <= ah.SMEM_BYTES
    opts = ah.kernel_options(cfg)
    # the partitions' registers (setmaxnreg) add up to at most the CTA's share of the SM's registers
    total = ah.CONSUMER_REGISTERS[cfg["CONSUMERS"]] * cfg["CONSUMERS"] + ah.PRODUCER_REGISTERS
    assert total <= opts["maxnreg"] * (cfg["CONSUMERS"] + 1)


@needs_gluon
@pytest.mark.parametrize("cfg, words", [
    (dict(BLOCK_M=32), "BLOCK_M"), (dict(BLOCK_N=256), "BLOCK_N"), (dict(CONSUMERS=4), "CONSUMERS"),
    (dict(STAGES=1), "STAGES"), (dict(BLOCK_Q=64), "unknown"),
    (dict(BLOCK_M=128, BLOCK_N=128, STAGES=4, CONSUMERS=3), "shared memory"),
    (dict(EXP2_POLY=8), "EXP2_POLY"), (dict(EXP2_POLY=-16), "EXP2_POLY"), (dict(EXP2_POLY=144), "EXP2_POLY"),
    (dict(EXP2_POLY=16.0), "EXP2_POLY"), (dict(EXP2_POLY=True), "EXP2_POLY"),
    (dict(BLOCK_N=64, EXP2_POLY=12), "multiple of BLOCK_N / 8 = 8"),
])
def test_bad_configs_are_refused(cfg, words):
    with pytest.raises(ValueError, match=words):
        ah.check_config(128, cfg)


@pytest.mark.parametrize("poly", [0, 16, 64, 112, 128])
def test_every_exp2_poly_multiple_of_an_eighth_is_taken(poly):
    assert ah.check_config(64, dict(EXP2_POLY=poly))["EXP2_POLY"] == poly
    assert ah.check_config(64, None)["EXP2_POLY"] == 0  # off unless a launch asks


def test_the_exp2_polynomial_is_within_its_stated_error():
    """Relative error against 2^x in fp64 on a dense grid of x in [-126, 0] (every fraction f = x - floor(x) of
    [0, 1) on a fine grid, shifted by every exponent), the same as over [0, 1) alone and below fp16's half ulp."""
    f = torch.linspace(0, 1, 2_000_001, dtype=torch.float64)[:-1].float()
    on_unit = ((ah.exp2_poly(f).double() / torch.exp2(f.double())) - 1).abs().max().item()
    assert 5e-5 < on_unit < 8.6e-5, on_unit  # the module's comment states 8.57e-5
    x = torch.cat([f[::20] + n for n in range(-126, 0)] + [torch.rand(1_000_000) * -126, -torch.rand(10_000) * 1e-3])
    rel = ((ah.exp2_poly(x).double() / torch.exp2(x.double())) - 1).abs().max().item()
    assert abs(on_unit - rel) < 1e-6, (on_unit, rel)  # adding n to the exponent is exact above 2^-126


def test_the_exp2_polynomial_is_exact_where_softmax_needs_it():
    """exp2(-inf) = 0 (masked scores) and 0 below the clamp, 2^0 = 1 (each row's max), integers exact powers of two,
    (-127, -126) within [0, 2^-126) (where ex2.approx.ftz gives 0), no NaN or negative value."""
    assert ah.exp2_poly(torch.tensor([float("-inf"), -1e30, -127.0, -200.5])).eq(0).all()
    k = torch.arange(0, 127, dtype=torch.float32)
    assert torch.equal(ah.exp2_poly(-k), torch.exp2(-k))
    tiny = ah.exp2_poly(-126.0 - torch.rand(10_000))
    assert (tiny >= 0).all() and (tiny < 2.0**-126).all()
    x = -torch.rand(1_000_000) * 200
    assert not ah.exp2_poly(x).isnan().any() and (ah.exp2_poly(x) >= 0).all()


def test_the_reference_masks_later_keys():
    q, k, v = (torch.randn(1, 5, 2, 8, dtype=torch.float64) for _ in range(3))
    out = ah.attention_reference_fp64(q, k, v, causal=True)
    assert torch.allclose(out[:, 0], v[:, 0])  # the first query sees the first key only
    scores = torch.einsum("bihd,bjhd->bhij", q, k) * 8**-0.5
    full = torch.einsum("bhij,bjhd->bihd", scores.softmax(-1), v)
    assert torch.allclose(ah.attention_reference_fp64(q, k, v, causal=False), full)


@needs_gluon
@pytest.mark.parametrize("config", [None] + VARIANTS + POLY_VARIANTS + [
    {"BLOCK_M": 128}, {"EXP2_POLY": 128}, {"BLOCK_N": 64, "EXP2_POLY": 8}, {"BLOCK_N": 64, "EXP2_POLY": 40}], ids=str)
@pytest.mark.parametrize("causal", [True, False])
def test_the_block_schedule_computes_the_reference(config, causal):
    """`attention_by_blocks` (the kernel's block counts, masks only past the unmasked blocks, its order of
    rescaling, P in fp16, EXP2_POLY columns by the polynomial) equals the fp64 attention up to P's rounding, on S
    around the blocks' edges."""
    for S in (1, 17, 64, 129, 300):
        q, k, v = torch.randn(2, S, 3, 2, 64, dtype=torch.float64).half().unbind(2)
        got = ah.attention_by_blocks(q, k, v, causal=causal, config=config)
        want = ah.attention_reference_fp64(q, k, v, causal=causal)
        assert (got - want).abs().max().item() < 2e-3, (S, config)


class _Barrier:
    """An mbarrier: a wait for parity P passes while the current phase's parity is not P; `count` arrivals end
    a phase."""

    def __init__(self, count=1):
        self.count, self.pending, self.phase = count, count, 0

    def passes(self, parity):
        return (self.phase & 1) != parity

    def arrive(self):
        self.pending -= 1
        assert self.pending >= 0
        if self.pending == 0:
            self.phase, self.pending = self.phase + 1, self.count


def _run_protocol(S, causal, cfg, seed):
    """The kernel's producer, consumers and ping-pong turns as coroutines over modelled mbarriers, the loads
    landing at random later steps, scheduled at random: every block a consumer reads holds that block, no load
    lands in a slot a consumer still reads, and all finish (no deadlock)."""
    import random

    rnd = random.Random(seed)
    bm, bn, st, cons, ping = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["STAGES"], cfg["CONSUMERS"], cfg["PINGPONG"]
    ready = {kv: [_Barrier() for _ in range(st)] for kv in "kv"}
    empty = {kv: [_Barrier() for _ in range(cons * st)] for kv in "kv"}
    turns = [_Barrier() for _ in range(cons)]
    slots = {kv: [None] * st for kv in "kv"}
    reading = {kv: [set() for _ in range(st)] for kv in "kv"}
    landing = []  # loads in flight: (kind, slot, block)

    def wait(bar, parity, pred=True):
        while pred and not bar.passes(parity):
            yield

    def producer(m0):
        n_last = ah.kv_blocks(m0 + (cons - 1) * bm, S, bm, bn, causal)[0]
        for j in range(n_last):
            slot, phase = j % st, ((j // st) & 1) ^ 1
            for kv in "kv":
                for c in range(cons):
                    n_c = ah.kv_blocks(m0 + c * bm, S, bm, bn, causal)[0]
                    yield from wait(empty[kv][c * st + slot], phase, j - st < n_c)
                landing.append((kv, slot, j))
                yield

    def take(kv, slot, j, c):
        yield from wait(ready[kv][slot], (j // st) & 1)
        assert slots[kv][slot] == j, (kv, slot, j, slots[kv][slot])
        reading[kv][slot].add(c)

    def give(kv, slot, j, c):
        assert slots[kv][slot] == j
        reading[kv][slot].discard(c)
        empty[kv][c * st + slot].arrive()

    def turn(c, t, on):
        if ping and on:
            yield from wait(turns[c], (t & 1) ^ (1 if c == 0 else 0))
            yield
            turns[(c + 1) % cons].arrive()

    def consumer(m0, c):
        n, _ = ah.kv_blocks(m0 + c * bm, S, bm, bn, causal)
        n_turns, _ = ah.kv_blocks(m0, S, bm, bn, causal)
        yield from take("k", 0, 0, c)
        yield from turn(c, 0, True)
        give("k", 0, 0, c)
        for j in range(1, n):
            yield from take("k", j % st, j, c)
            yield from take("v", (j - 1) % st, j - 1, c)
            yield from turn(c, j, j < n_turns)
            give("k", j % st, j, c)
            yield
            give("v", (j - 1) % st, j - 1, c)
        yield from take("v", (n - 1) % st, n - 1, c)
        give("v", (n - 1) % st, n - 1, c)

    for m0 in range(0, S, cons * bm):
        tasks = [producer(m0)] + [consumer(m0, c) for c in range(cons)]
        steps = 0
        while tasks or landing:
            steps += 1
            assert steps < 10**6, "deadlock"
            if landing and rnd.random() < 0.3:  # a load lands: nobody may be reading its slot
                kv, slot, j = landing.pop(rnd.randrange(len(landing)) if rnd.random() < 0.2 else 0)
                assert not reading[kv][slot], (kv, slot, j, reading[kv][slot])
                slots[kv][slot] = j
                ready[kv][slot].arrive()
                continue
            if not tasks:
                continue
            task = rnd.choice(tasks)
            try:
                next(task)
            except StopIteration:
                tasks.remove(task)
        ready = {kv: [_Barrier() for _ in range(st)] for kv in "kv"}  # a CTA of its own: fresh barriers
        empty = {kv: [_Barrier() for _ in range(cons * st)] for kv in "kv"}
        turns = [_Barrier() for _ in range(cons)]
        slots = {kv: [None] * st for kv in "kv"}


@needs_gluon
@pytest.mark.parametrize("config", [None] + VARIANTS + [{"BLOCK_M": 128, "BLOCK_N": 64, "STAGES": 2, "CONSUMERS": 3}],
                         ids=str)
@pytest.mark.parametrize("causal", [True, False])
def test_the_barrier_protocol_delivers_every_block_without_deadlock(config, causal):
    """(The last launch has consumers whose causal ranges differ by more than the ring: the producer must not
    wait for a consumer to hand back a block it never read.)"""
    cfg = ah.check_config(64, config)
    for S in (1, 65, 200, 700):
        for seed in range(3):
            _run_protocol(S, causal, cfg, seed)


# ----------------------------------------------------------------------------------------------
# CPU: the sm_90a build (Triton's compiler and ptxas, no GPU)
# ----------------------------------------------------------------------------------------------
COMPILE = textwrap.dedent('''
    import json, re, sys
    import torch
    from shapewise.kernels import attention_hopper as ah
    from benchmarks.sm90 import compile_sm90, ptxas_report


    def build(head_dim, causal, cfg):
        """The kernel for sm_90a at the launch `hopper_attention` makes for this head dim, causal flag and config."""
        cfg = ah.check_config(head_dim, cfg)
        view = torch.zeros(1, 256, 3, 2, head_dim, dtype=torch.float16).unbind(2)[0]  # a packed QKV's q
        args = {"q_desc": ah.descriptor(view, cfg["BLOCK_M"]), "k_desc": ah.descriptor(view, cfg["BLOCK_N"]),
                "v_desc": ah.descriptor(view, cfg["BLOCK_N"]), "o_desc": ah.descriptor(view, cfg["BLOCK_M"]),
                "qk_scale": "fp32"}
        consts = dict(HEAD_DIM=head_dim, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], STAGES=cfg["STAGES"],
                      CONSUMERS=cfg["CONSUMERS"], PINGPONG=cfg["PINGPONG"], IS_CAUSAL=causal,
                      EXP2_POLY=cfg["EXP2_POLY"],
                      CONSUMER_REGS=ah.CONSUMER_REGISTERS[cfg["CONSUMERS"]], PRODUCER_REGS=ah.PRODUCER_REGISTERS)
        return compile_sm90(ah._attention_hopper_fwd, consts, args, ah.kernel_options(cfg)), cfg

    def ptxas(kernel):
        """ptxas -v on the kernel's PTX: (registers per thread it allocates, spill bytes, its messages)."""
        report = ptxas_report(kernel)
        return report.registers, report.spill_bytes, report.text

    launches = [(d, causal, None) for d in ah.HEAD_DIMS for causal in (True, False)]
    launches += [(64, True, v) for v in json.loads(sys.argv[1])]
    exps = {}  # exp2s (MUFU's ex2 and the polynomial's round-down add) by launch less EXP2_POLY
    for head_dim, causal, cfg in launches:
        kernel, full = build(head_dim, causal, cfg)
        regs, spills, text = ptxas(kernel)
        ptx = kernel.asm["ptx"]
        partitions = sorted({int(n) for n in re.findall(r"setmaxnreg\\.inc\\.sync\\.aligned\\.u32\\s+(\\d+)", ptx)})
        ex2, poly = len(re.findall(r"\\bex2\\.approx", ptx)), len(re.findall(r"\\badd\\.rm\\.f32", ptx))
        record = dict(head_dim=head_dim, causal=causal, config=full, ptxas_registers=regs,
                      setmaxnreg_inc=partitions, spill_bytes=spills, shared_bytes=kernel.metadata.shared,
                      ex2=ex2, exp2_poly=poly)
        # each score's exp2 one way: the polynomial's take the place of as many ex2 (none computed twice), and
        # only EXP2_POLY launches have any
        key = json.dumps([head_dim, causal, {k: v for k, v in full.items() if k != "EXP2_POLY"}], sort_keys=True)
        exps.setdefault(key, ex2 + poly)
        assert exps[key] == ex2 + poly and (poly > 0) == (full["EXP2_POLY"] > 0), (record, exps[key])
        print("compiled", json.dumps(record), flush=True)
        assert kernel.asm["cubin"], record
        assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx, record
        assert spills == 0, (record, text)
        assert "serialized" not in text, (record, text)  # ptxas waits after each wgmma where registers run short
        assert kernel.metadata.shared <= ah.SMEM_BYTES, record
        assert ah.CONSUMER_REGISTERS[full["CONSUMERS"]] in partitions, record  # the consumers' setmaxnreg
''')


@needs_gluon
def test_the_kernel_builds_for_sm90_without_spills():
    """Every launch compiles for sm_90a (D 64 and 128, causal and not; the sweep's variants at D=64, EXP2_POLY's
    after the default, against which their exp2 count) with no register spill and no serialized wgmma; the records
    printed (pytest -s) give ptxas's registers, the partitions' setmaxnreg, the shared memory and the exp2s by
    ex2 and by the polynomial."""
    import json

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "workflow"), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", COMPILE, json.dumps(VARIANTS + POLY_VARIANTS)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    print(done.stdout)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-6000:]
    assert done.stdout.count("compiled") == 2 * len(ah.HEAD_DIMS) + len(VARIANTS) + len(POLY_VARIANTS)


# ----------------------------------------------------------------------------------------------
# On a Hopper GPU
# ----------------------------------------------------------------------------------------------
def _qkv(B, S, H, D, layout, seed=0):
    """q, k, v [B, S, H, D] fp16 on the GPU: views of a packed [B, S, 3, H, D] QKV ("packed", what the model
    passes), contiguous tensors, or views whose heads are S * D apart ("heads_outer", copied by the launcher)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    if layout == "packed":
        qkv = torch.randn(B, S, 3, H, D, device="cuda", generator=g).half()
        return qkv.unbind(2)
    if layout == "contiguous":
        return tuple(torch.randn(B, S, H, D, device="cuda", generator=g).half() for _ in range(3))
    assert layout == "heads_outer"
    return tuple(torch.randn(B, H, S, D, device="cuda", generator=g).half().transpose(1, 2) for _ in range(3))


def _check(q, k, v, causal, assert_close, what, config=None):
    before = [t.clone() for t in (q, k, v)]
    out = ah.hopper_attention(q, k, v, causal=causal, config=config)
    unchanged = all(torch.equal(t, b) for t, b in zip((q, k, v), before, strict=True))
    assert unchanged, "hopper_attention wrote into its inputs"
    assert out.shape == q.shape and out.dtype == torch.float16 and out.is_contiguous()
    assert not torch.isnan(out).any(), f"NaN in {what}"
    ref = ah.attention_reference_fp64(q, k, v, causal=causal)
    atol, rtol = TOL[out.dtype]
    assert_close(out.float(), ref, atol=atol, rtol=rtol, what=what)


# S: one token, less than a block, one block, one past it, ragged and long; H cycled so that every S meets
# several head counts; B = 2 where a query block's rows must stop at its own batch element's end
GPU_CASES = [(B, S, H) for S, Hs in ((1, (1, 3)), (17, (3, 16)), (128, (1, 16)), (129, (3, 1)), (1000, (16, 3)),
                                    (4097, (1,))) for B, H in zip((1, 2), Hs, strict=False)]


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("layout", ["packed", "contiguous", "heads_outer"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("D", ah.HEAD_DIMS)
@pytest.mark.parametrize("B, S, H", GPU_CASES, ids=lambda x: str(x))
def test_kernel_matches_fp64(B, S, H, D, causal, layout, assert_close):
    q, k, v = _qkv(B, S, H, D, layout)
    _check(q, k, v, causal, assert_close, f"hopper_attention B={B} S={S} H={H} D={D} causal={causal} {layout}")


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("config", VARIANTS + POLY_VARIANTS + [
    dict(BLOCK_M=128, BLOCK_N=128, STAGES=2), dict(EXP2_POLY=128),
    dict(BLOCK_N=64, CONSUMERS=3, STAGES=4, EXP2_POLY=16)], ids=str)
def test_every_swept_launch_matches_fp64(config, causal, assert_close):
    """The launches the row-14 sweep times (128 query rows a consumer too: it spills, but must be right), every
    exp2 by the polynomial, and an eighth of them at three consumers of 64 keys a slot."""
    q, k, v = _qkv(2, 1000, 3, 64, "packed", seed=1)
    _check(q, k, v, causal, assert_close, f"hopper_attention {config} causal={causal}", config=config)


@pytest.mark.gpu
@needs_hopper
def test_a_long_causal_sequence_matches_fp64(assert_close):
    """B=1, S=8192, H=16, D=64 causal: the row-14 head shape at a length the fp64 reference can hold (the
    default launch and a half of the exp2s by the polynomial)."""
    q, k, v = _qkv(1, 8192, 16, 64, "packed", seed=2)
    for config in (None, dict(EXP2_POLY=64)):
        out = ah.hopper_attention(q, k, v, causal=True, config=config)
        assert not torch.isnan(out).any()
        for h in range(0, 16, 5):  # a few heads: the fp64 scores of one head are 0.5 GB
            sl = slice(h, h + 1)
            ref = ah.attention_reference_fp64(q[:, :, sl], k[:, :, sl], v[:, :, sl], causal=True)
            assert_close(out[:, :, sl].float(), ref, atol=TOL[torch.float16][0], rtol=TOL[torch.float16][1],
                         what=f"S=8192 head {h} {config}")


@pytest.mark.gpu
@needs_hopper
def test_a_view_of_the_output_is_refused_and_an_out_is_filled():
    q, k, v = _qkv(1, 300, 2, 64, "packed")
    out = torch.full((1, 300, 2, 64), float("nan"), dtype=torch.float16, device="cuda")
    assert ah.hopper_attention(q, k, v, causal=True, out=out) is out
    assert not torch.isnan(out).any()
    with pytest.raises(ValueError, match="contiguous"):
        ah.hopper_attention(q, k, v, causal=True, out=torch.empty(1, 2, 300, 64, dtype=torch.float16,
                                                                  device="cuda").transpose(1, 2))


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("mask_kind", ["none", "all_true", "prefix", "holes"])
def test_the_triton_route_runs_it_where_the_policy_says_so(monkeypatch, mask_kind):
    """Policy attention.hopper_from_seq_len covering the shape: the triton route's attention is this kernel, exact
    against an fp64 forward (under a causal prefix mask it runs unmasked, under holes our Triton kernel takes the
    call); the hopper_attention switch off runs SDPA."""
    from model_helpers import build_pair, cfg_of, check_official, cuda_case
    from shapewise.model import routing

    monkeypatch.setitem(routing.POLICY, "attention", {"sdpa_from_seq_len": 256, "hopper_from_seq_len": 256})
    monkeypatch.setitem(routing.POLICY, "graph", {"max_tokens_x_d_model": 1})  # the eager triton route
    cfg = cfg_of((2, 700, 128, 2, 256, 2))  # head_dim 64
    opt, x, mask, want = cuda_case(cfg, mask_kind)
    with torch.inference_mode():
        got = opt(x, mask).cpu()
    assert opt.last_route.name == "triton", str(opt.last_route)
    expected = "triton" if mask_kind == "holes" else "hopper"
    assert opt.last_route.attention == expected, str(opt.last_route)
    check_official(want, got, f"triton route with the Hopper attention, {mask_kind}")
    _, off = build_pair(cfg, "auto", disable=("hopper_attention",))
    off.load_state_dict(opt.state_dict())
    with torch.inference_mode():
        check_official(want, off.cuda()(x, mask).cpu(), f"hopper_attention off, {mask_kind}")
    assert off.last_route.attention != "hopper", str(off.last_route)
