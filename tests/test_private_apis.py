"""The private APIs the code relies on (docs/decisions.md, private-apis): each test names the API and fails when an
upgrade of Python, torch or Triton changes it, instead of a pipeline run going wrong later."""

import functools
import inspect
import json
import subprocess
import sys
import types

import pytest
import torch

from checkout import REPO


def test_atexit_clears_then_runs_handlers_without_exiting():
    """shapewise.execution.jobserver._child: a job forked from the job server drops the server's exit handlers
    (atexit._clear) and runs its own before os._exit (atexit._run_exitfuncs)."""
    code = ("import atexit, os, sys\n"
            "atexit.register(print, 'server')\n"
            "atexit._clear()\n"
            "atexit.register(print, 'job')\n"
            "atexit._run_exitfuncs()\n"
            "print('after', atexit._ncallbacks())\n"
            "sys.stdout.flush()\n"
            "os._exit(3)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (3, "job\nafter 0\n"), done.stdout + done.stderr


def test_triton_autotuner_has_what_gpushare_wraps():
    """shapewise.execution.gpushare wraps Autotuner.check_disk_cache and Autotuner._bench (as WRAPPED names them) and
    swaps the per-instance `do_bench` (a cached property of Autotuner) for one untimed launch."""
    pytest.importorskip("triton")
    from triton.runtime.autotuner import Autotuner

    from shapewise.execution import gpushare

    assert gpushare.unavailable() is None  # a job would hold its GPU alone on every kernel choice otherwise
    assert isinstance(inspect.getattr_static(Autotuner, "do_bench"), functools.cached_property)
    assert "base_fn" in inspect.getsource(Autotuner.__init__)


def test_torch_internals_the_model_reads():
    """model/weights.py: the `data` descriptor of torch._C.TensorBase (WatchedParameter wraps it) and a tensor's
    `_version` counter (the weight check); model/optimized.py and model/memory.py: torch._C's current raw stream and
    memory fraction readers where torch is built with CUDA (a CPU build has neither: the models take the public
    calls there)."""
    data = inspect.getattr_static(torch._C.TensorBase, "data")
    assert isinstance(data, types.GetSetDescriptorType) and torch.Tensor.data is data  # the public spelling
    t = torch.zeros(2)
    before = t._version
    t.add_(1)
    assert isinstance(before, int) and t._version == before + 1
    if not torch.backends.cuda.is_built():
        pytest.skip(f"torch {torch.__version__} is built without CUDA: no torch._C._cuda_* here")
    for name in ("_cuda_getCurrentRawStream", "_cuda_getMemoryFraction"):
        assert callable(getattr(torch._C, name, None)), f"torch._C.{name} is gone"
    if torch.cuda.is_available():
        index = torch.cuda.current_device()
        assert torch._C._cuda_getCurrentRawStream(index) == torch.cuda.current_stream(index).cuda_stream
        assert torch._C._cuda_getMemoryFraction(index) == torch.cuda.get_per_process_memory_fraction(index)


def test_triton_compile_internals_the_sass_benchmark_uses():
    """benchmarks/sm90.py compiles the Gluon kernels for sm_90 without a GPU: GluonASTSource(fn, signature,
    constexprs, attrs) and mangle_type(arg) give Triton's compiler the signature a launch would."""
    runtime = pytest.importorskip("triton.experimental.gluon._runtime")
    from triton.runtime.jit import mangle_type

    assert list(inspect.signature(runtime.GluonASTSource).parameters) == ["fn", "signature", "constexprs", "attrs"]
    assert list(inspect.signature(mangle_type).parameters)[0] == "arg" and mangle_type(1.0) == "fp32"


def test_the_weight_check_benchmark_replaces_a_runner_through_the_models_paths():
    """benchmarks/weight_check.py and host_parts.py swap the runner of one input signature in
    UserOptimizedTransformer._paths (keyed (shape, dtype, device, mask is None), each runner with its `route`)."""
    code = ("import json\n"
            "from benchmarks.weight_check import measure\n"
            "from shapewise.inputs.manifest import load_manifest\n"
            "row = load_manifest('shapes/smoke.yaml')[0]\n"
            "print(json.dumps(measure(row, calls=2, repeats=1)))\n")
    # the benchmarks are modules of the checkout (python -c puts its working directory first on the path)
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.splitlines()[-1])
    assert all(out[k] > 0 for k in ("before_runner", "weight_check", "identity")), out
