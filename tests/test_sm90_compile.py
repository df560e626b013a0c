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

    from shapewise.kernels import attention, fused_layer, layer_tail, layernorm, mask

    FLOATS = ("qk_scale", "eps")

    def compile_for_h200(fn, pointers, consts, num_warps, num_stages, **options):
        names = fn.arg_names
        sig = {n: pointers.get(n, "fp32" if n in FLOATS else "constexpr" if n in consts else "i32") for n in names}
        src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()})
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
    print("compiled", len(done), "kernels:", "; ".join(done))
''')


# attention 4 (the last: a mask with its own loop), mask summary 1, ln_kv 2 x 2 (PDL off and on), layer tail 4,
# fused layer 6 x 3, add+LayerNorm 2; each PDL kernel compiled with PDL on in some of its variants
N_KERNELS = 4 + 1 + 2 * 2 + 4 + 6 * 3 + 2


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
