"""Every Triton kernel compiles for the H200 (sm_90a), in each variant of its feature switches, on a machine
without a GPU.

The interpreter that runs the kernels in the other CPU tests accepts code the compiler refuses: a module-level
constant read inside a kernel runs there and fails to compile on a GPU (only `tl.constexpr` globals compile).
This test compiles each kernel to a cubin with Triton's own compiler and ptxas for GPUTarget("cuda", 90, 32), in a
subprocess without TRITON_INTERPRET (conftest sets it for this process, and a kernel decorated under it is no
longer compilable), at launches the launchers use.
"""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = textwrap.dedent('''
    import itertools, sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from shapewise.kernels import attention, fused_layer, fused_linear, layer_tail, layernorm, mask

    FLOATS = ("qk_scale", "eps")

    def compile_for_h200(fn, pointers, consts, num_warps, num_stages, divisible=(), **options):
        """divisible: arguments Triton's launcher would see as multiples of 16 (pointers and strides of aligned
        rows), which decides whether loads vectorize and pipeline."""
        names = fn.arg_names
        sig = {n: pointers.get(n, "fp32" if n in FLOATS else "constexpr" if n in consts else "i32") for n in names}
        src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()},
                        attrs={(names.index(n),): [["tt.divisibility", 16]] for n in divisible})
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                options=dict(num_warps=num_warps, num_stages=num_stages, **options))
        assert kernel.asm["cubin"], fn.__name__
        # PDL (kernels/pdl.py: 1 releases the next kernel at the end, 2 at the start) and only it puts the grid-dependency wait and release into the kernel
        for op in ("griddepcontrol.wait", "griddepcontrol.launch_dependents"):
            assert (op in kernel.asm["ptx"]) == bool(consts.get("PDL")), (fn.__name__, op, consts)
        return kernel

    def flags(*names):
        return [dict(zip(names, values)) for values in itertools.product((False, True), repeat=len(names))]

    done = []
    fp16, fp32, i8, i32 = "*fp16", "*fp32", "*i8", "*i32"
    att = dict(Q=fp16, K=fp16, V=fp16, Out=fp16, KeyLen=i32, KeyMask=i8)
    for lens, keys, own_loop in ((False, False, False), (True, False, False), (True, True, False), (True, True, True)):
        consts = dict(HEAD_DIM=32, BLOCK_D=32, BLOCK_M=64, BLOCK_N=64, IS_CAUSAL=True, HAS_KEY_LEN=lens,
                      HAS_KEY_MASK=keys, EVEN_N=False, PRECISION=2, MASK_LOOP=own_loop, PDL=2 * keys)
        cap = attention.masked_register_cap(64, 64, 32, 4, 3) if keys else None
        compile_for_h200(attention._attention_fwd, att, consts, 4, 3, **({"maxnreg": cap} if cap else {}))
        done.append(f"_attention_fwd {lens} {keys} {own_loop} pdl={2 * keys}")
    compile_for_h200(mask._prefix_lengths_fwd, dict(Mask=i8, Out=i32), dict(BLOCK=128), 1, 1)
    done.append("_prefix_lengths_fwd")
    for f in flags("WRITE_PREFIX", "PDL"):
        f["PDL"] = int(f["PDL"])
        compile_for_h200(fused_layer._ln_kv_fwd,
                         dict(X=fp32, KV=fp16, Wqkv=fp16, Bqkv=fp16, N1w=fp32, N1b=fp32, Mask=i8, PrefixOut=i32),
                         dict(BLOCK_T=64, BLOCK_D=128, BLOCK_N=64, MASK_BLOCK=128, **f), 4, 1)
        done.append(f"_ln_kv_fwd {f}")
    tail = dict(Att=fp16, X=fp32, Y=fp32, Mask=i8, Wo=fp16, Bo=fp16, Win=fp16, Bin=fp16, Wout=fp16, Bout=fp16,
                N2w=fp32, N2b=fp32, NFw=fp32, NFb=fp32)
    # the four mask / final-norm variants
    for f in flags("HAS_MASK", "FINAL_NORM"):
        f["PDL"] = int(f["HAS_MASK"] and not f["FINAL_NORM"])
        compile_for_h200(layer_tail._layer_tail_fwd, tail, dict(BLOCK_M=64, BLOCK_D=128, BLOCK_F=32, **f), 4, 3)
        done.append(f"_layer_tail_fwd {f}")
    layer = dict(tail, Wqkv=fp16, Bqkv=fp16, N1w=fp32, N1b=fp32, KV=fp16)
    # without a mask; with one: the summary computed, computed and written, read; then the row-mask switch on
    # (ROW_MASK_BRANCH) with the summary written and read
    summaries = [(False, False, False, False), (True, False, False, False), (True, False, True, False),
                 (True, True, False, False), (True, False, True, True), (True, True, False, True)]
    for (has_mask, given, write, switches), (kv, block_n) in itertools.product(
            summaries, ((False, 128), (True, 128), (True, 32))):
        consts = dict(NUM_HEADS=4, HEAD_DIM=32, BLOCK_HD=32, BLOCK_D=128, BLOCK_F=64, BLOCK_M=32, BLOCK_S=128,
                      IS_CAUSAL=True, FINAL_NORM=True, HAS_MASK=has_mask, KV_GLOBAL=kv, BLOCK_N=block_n,
                      PREFIX_IN=given, PREFIX_OUT=write, ROW_MASK_BRANCH=switches, PDL=int(kv and given))
        compile_for_h200(fused_layer._fused_layer_fwd, dict(layer, Prefix=i32), consts, 4, 2)
        done.append(f"_fused_layer_fwd mask={has_mask} given={given} write={write} kv={kv} block_n={block_n} "
                    f"switches={switches} pdl={kv and given}")
    for f in flags("HAS_ROW_MASK"):
        compile_for_h200(layernorm._add_layernorm_fwd,
                         dict(R=fp32, Br=fp16, W=fp32, Bias=fp32, RowMask=i8, ResOut=fp32, Out=fp16),
                         dict(BLOCK_ROWS=4, BLOCK_D=128, HAS_BRANCH=True, WRITE_RESIDUAL=True, PDL=int(f["HAS_ROW_MASK"]),
                              **f), 4, 1)
        done.append(f"_add_layernorm_fwd {f}")
    # fused_linear at its default launch, in the variants the model's layer would use and with a K edge: on
    # sm_90 its dots must be wgmma fed by pipelined cp.async loads, within the SM's 227 KB of shared memory
    linear = dict(A=fp16, W=fp16, Bias=fp32, Mean=fp32, Rstd=fp32, Res=fp32, RowMask=i8, Y=fp16, Stats=fp32)
    aligned = [n for n in fused_linear._fused_linear_fwd.arg_names
               if n in linear or n.startswith("stride") or n in ("N", "K")]  # the launcher refuses other N, K
    no_extras = dict(HAS_LN=False, GELU=False, HAS_RES=False, HAS_ROW_MASK=False, HAS_STATS=False, EVEN_K=True,
                     TMA=False)
    for f in (dict(), dict(GELU=True), dict(HAS_LN=True), dict(HAS_LN=True, GELU=True),
              dict(HAS_RES=True, HAS_STATS=True), dict(HAS_RES=True, HAS_ROW_MASK=True, HAS_STATS=True),
              dict(HAS_LN=True, GELU=True, HAS_RES=True, HAS_ROW_MASK=True, HAS_STATS=True), dict(EVEN_K=False)):
        pointers = dict(linear, A=fp32 if f.get("HAS_LN") else fp16, Y=fp32 if f.get("HAS_RES") else fp16)
        consts = dict(BLOCK_M=fused_linear.BLOCK_M, BLOCK_N=fused_linear.BLOCK_N, BLOCK_K=fused_linear.BLOCK_K,
                      GROUP_M=fused_linear.GROUP_M, **dict(no_extras, **f))
        k = compile_for_h200(fused_linear._fused_linear_fwd, pointers, consts, fused_linear.NUM_WARPS,
                             fused_linear.NUM_STAGES, divisible=aligned)
        ptx = k.asm["ptx"]
        assert "wgmma.mma_async" in ptx and "cp.async" in ptx, ("fused_linear: no wgmma or no cp.async", f)
        assert k.metadata.shared <= 227 * 1024, ("fused_linear: shared memory", k.metadata.shared, f)
        done.append(f"_fused_linear_fwd {f}")
    # the TMA variant (tma=True): the tiles by host descriptors, A in fp16 and (the LayerNorm prologue's) fp32
    import torch
    from triton.runtime.jit import mangle_type
    from triton.tools.tensor_descriptor import TensorDescriptor

    def desc(dtype, rows):
        return mangle_type(TensorDescriptor.from_tensor(torch.zeros(256, 256, dtype=dtype),
                                                        [rows, fused_linear.BLOCK_K]))

    for f in (dict(), dict(HAS_LN=True, GELU=True), dict(HAS_RES=True, HAS_ROW_MASK=True, HAS_STATS=True)):
        pointers = dict(linear, A=desc(torch.float32 if f.get("HAS_LN") else torch.float16, fused_linear.BLOCK_M),
                        W=desc(torch.float16, fused_linear.BLOCK_N), Y=fp32 if f.get("HAS_RES") else fp16)
        consts = dict(BLOCK_M=fused_linear.BLOCK_M, BLOCK_N=fused_linear.BLOCK_N, BLOCK_K=fused_linear.BLOCK_K,
                      GROUP_M=fused_linear.GROUP_M, **dict(no_extras, TMA=True, **f))
        k = compile_for_h200(fused_linear._fused_linear_fwd, pointers, consts, fused_linear.NUM_WARPS,
                             fused_linear.NUM_STAGES, divisible=[n for n in aligned if n not in ("A", "W")])
        ptx = k.asm["ptx"]
        assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx, ("fused_linear TMA: no wgmma or TMA", f)
        assert k.metadata.shared <= 227 * 1024, ("fused_linear TMA: shared memory", k.metadata.shared, f)
        done.append(f"_fused_linear_fwd TMA {f}")
    compile_for_h200(fused_linear._layernorm_stats_fwd, dict(Stats=fp32, Mean=fp32, Rstd=fp32),
                     dict(BLOCK_N=fused_linear.BLOCK_N, BLOCK_ROWS=128), 4, 1)
    done.append("_layernorm_stats_fwd")
    print("compiled", len(done), "kernels:", "; ".join(done))
''')


# attention 4 (the last: a mask with its own loop), mask summary 1, ln_kv 2 x 2 (PDL off and on), layer tail 4,
# fused layer 6 x 3, add+LayerNorm 2, fused linear 8 by pointers and 3 by TMA and its statistics merge 1; each PDL
# kernel compiled with PDL on in some of its variants
N_KERNELS = 4 + 1 + 2 * 2 + 4 + 6 * 3 + 2 + 8 + 3 + 1


def _compiler_available():
    try:
        import triton  # noqa: F401
        from triton.backends.compiler import GPUTarget  # noqa: F401
    except ImportError:
        return False
    ptxas = Path(__import__("triton").__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    return ptxas.is_file()


@pytest.mark.skipif(not _compiler_available(), reason="Triton's NVIDIA backend (ptxas) is not installed")
def test_every_kernel_compiles_for_sm90_in_every_variant():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "workflow"), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=900)
    assert done.returncode == 0, f"a kernel does not compile for sm_90a:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    assert f"compiled {N_KERNELS} kernels" in done.stdout, done.stdout
