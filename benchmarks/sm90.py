"""Offline builds for sm_90a, no GPU needed: what ptxas reports of a kernel Triton (or Gluon) compiled for it."""
from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import dataclass

import triton

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


@dataclass(frozen=True)
class PtxasReport:
    registers: int  # per thread, as ptxas allocates them
    spill_store_bytes: int
    spill_load_bytes: int
    text: str  # ptxas's messages (a "serialized" wgmma among them, where registers run short)

    @property
    def spill_bytes(self) -> int:
        return self.spill_store_bytes + self.spill_load_bytes


def ptxas_report(kernel, arch: str = "sm_90a") -> PtxasReport:
    """`ptxas -v` on the compiled kernel's PTX (Triton's own ptxas), assembled for `arch`."""
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "k.ptx")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        done = subprocess.run([PTXAS, "-v", "--gpu-name", arch, ptx, "-o", os.path.join(tmp, "k.cubin")],
                              capture_output=True, text=True, check=True)
    text = done.stdout + done.stderr
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    stores, loads = (int(spills[1]), int(spills[2])) if spills else (0, 0)
    return PtxasReport(int(re.search(r"Used (\d+) registers", text)[1]), stores, loads, text)


def compile_sm90(fn, consts: dict, args: dict, options: dict, attrs=None):
    """Gluon kernel `fn` compiled for sm_90a as a launch specializes it, no GPU needed: `consts` its constexprs,
    `args` the type of each other argument by name (a TMA descriptor object, or a signature string such as "*fp16"
    or "fp32"; "i32" for one not named), `options` the launch's (num_warps, maxnreg), `attrs` GluonASTSource's
    (divisibility hints)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    types = {n: args.get(n, "i32") for n in fn.arg_names if n not in consts}
    sig = {n: "constexpr" if n in consts else t if isinstance(t := types[n], str) else mangle_type(t)
           for n in fn.arg_names}
    src = GluonASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()},
                         attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
