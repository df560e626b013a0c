"""Programmatic dependent launch (PDL, sm_90 and later) between the kernels of one forward.

A kernel launched with `launch_pdl` may be scheduled while the kernel before it on the stream still runs: as soon as
every program of that kernel has executed `griddepcontrol.launch_dependents` (`pdl_release_start` or
`pdl_release_end`, as RELEASE says) or ended. Its programs then stop in `griddepcontrol.wait` (`pdl_wait`) until that
kernel has finished and its writes are visible. Launch latency and whatever a kernel does before its wait overlap the
previous kernel's last programs.

The rule every kernel here keeps, so that PDL changes no result: before its wait a kernel reads only weights and
writes nothing. No kernel of a forward writes weights, and a forward's first kernel launches without PDL (it waits
for everything before it, weight edits included), so every weight read sees the forward's weights.
"""
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from . import INTERPRET


# Where a kernel launched with PDL lets the next one be scheduled: "end" (after its last store) or "start" (its first
# instruction: the next kernel's programs may then sit on the SMs, waiting, while this one runs). The launchers read it
# at each launch (`python -m benchmarks.switch_ab --switch pdl --release start` measures the other).
RELEASE = "end"
_CODES = {"end": 1, "start": 2}  # the kernels' PDL constexpr; 0: launched without PDL


@triton.jit
def pdl_release_start(PDL: tl.constexpr):
    """Let the next kernel on the stream be scheduled once every program of this one got here (PDL, "start")."""
    if PDL == 2:
        gdc_launch_dependents()


@triton.jit
def pdl_release_end(PDL: tl.constexpr):
    """Let the next kernel on the stream be scheduled once every program of this one got here (PDL, "end")."""
    if PDL == 1:
        gdc_launch_dependents()


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Wait until the previous kernel on the stream has finished and its writes are visible (PDL only)."""
    if PDL != 0:
        gdc_wait()


def launch_options(pdl: bool, where: str) -> dict:
    """The PDL keywords of a launch: the kernel's PDL constexpr (0 without PDL) and, with it, `launch_pdl`. The
    interpreter has no PDL: there a request is refused, naming the launcher."""
    if not pdl:
        return {"PDL": 0}
    if INTERPRET:
        raise ValueError(f"{where}: pdl=True needs a CUDA GPU (sm_90 or later); Triton's interpreter has no PDL")
    if RELEASE not in _CODES:
        raise ValueError(f"kernels.pdl.RELEASE must be one of {tuple(_CODES)}, got {RELEASE!r}")
    return {"PDL": _CODES[RELEASE], "launch_pdl": True}
