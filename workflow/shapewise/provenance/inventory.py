"""What a result was measured with: the implementation's files, the installed software and the machine, and
the digests (fingerprints) that stand for them.

`cheap_environment()` and `implementation()` import no torch: Snakemake calls
them while it builds the DAG, and their digests become `params:` of the
fingerprint rule, so an unchanged environment or implementation reruns
nothing. `job_environment()` adds what only a job on the compute node can see
(torch's view of the GPU) and is recorded in every per-shape result, so the
report can group results by the machine that produced them.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
from pathlib import Path

# Files whose content defines "the implementation": every source or data file
# of the model and its kernels (the routing policy data file included, if any).
IMPLEMENTATION_DIRS = ("model", "kernels")
IMPLEMENTATION_SUFFIXES = (".py", ".json", ".yaml", ".yml", ".csv", ".toml")


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def canonical_json(obj) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def digest_of(obj) -> str:
    return sha256_bytes(canonical_json(obj).encode())


def implementation_files(root="."):
    root = Path(root)
    files = []
    for name in IMPLEMENTATION_DIRS:
        base = root / name
        if base.is_dir():
            files += [p for p in base.rglob("*") if p.is_file() and p.suffix in IMPLEMENTATION_SUFFIXES
                      and "__pycache__" not in p.parts]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def implementation(root="."):
    """SHA-256 of each implementation file plus one digest over all of them."""
    root = Path(root)
    files = {p.relative_to(root).as_posix(): sha256_file(p) for p in implementation_files(root)}
    return {"files": files, "digest": digest_of(files)}


def _run(cmd):
    if shutil.which(cmd[0]) is None:
        return None
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def nvidia_smi_gpus():
    """[(name, driver, memory_total)] from nvidia-smi, or [] when there is none."""
    out = _run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"])
    if not out:
        return []
    return [tuple(part.strip() for part in line.split(",")) for line in out.splitlines() if line.strip()]


def cpu_model():
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


SOFTWARE_SEPARATOR = " | software "  # between the GPU model and the software digest in a machine key
PROJECT = "shapewise"  # its own code is the implementation digest's: installed or not, the software is the same


def installed_packages():
    names = set()
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if name and name.lower() != PROJECT:
            names.add(f"{name.lower()}=={dist.version}")
    return sorted(names)


def _version(name):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


_CHEAP = []  # cheap_environment() once read in this process: what it reads does not change while a run lasts


def cheap_environment():
    """The environment as far as it can be read without importing torch (read once per process: a job server
    reads it before it forks its jobs, shapewise.execution.jobserver)."""
    if not _CHEAP:
        _CHEAP.append(_read_cheap_environment())
    return dict(_CHEAP[0])


def _read_cheap_environment():
    gpus = nvidia_smi_gpus()
    packages = installed_packages()
    return {
        "gpu_names": sorted({g[0] for g in gpus}),
        "gpu_count": len(gpus),
        "driver": gpus[0][1] if gpus else None,
        "torch": _version("torch"),
        "triton": _version("triton"),
        "python": platform.python_version(),
        "python_executable": sys.executable,
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "packages_sha256": sha256_bytes("\n".join(packages).encode()),
        "package_count": len(packages),
    }


def software_environment():
    """The part of the environment that is the same on every node of a
    cluster sharing one file system: what decides reruns."""
    env = cheap_environment()
    return {k: env[k] for k in ("torch", "triton", "python", "python_executable", "packages_sha256")}


def job_environment(device: str, process: dict):
    """Everything a result needs to say where it came from; imports torch. `process`: how the job's process
    started (shapewise.execution.jobprocess.process_record), handed in by the caller: the job process's modules read
    this one (shapewise.execution.jobserver), never the other way round."""
    import torch  # deferred: torch, for a job's result only (the report and compare read the rest)

    env = cheap_environment()
    env["host"] = socket.gethostname()
    env["platform"] = platform.platform()
    env["device"] = device
    env["torch_full"] = torch.__version__
    env["cuda_runtime"] = torch.version.cuda
    # Inside a pipeline job these are only the pipeline's own (SHAPEWISE_PIPELINE_*) and those config
    # pass_env passed on: shapewise.cli removes every other SHAPEWISE_* variable of the user's shell.
    env["shapewise_variables"] = shapewise_variables()
    env["job_process"] = process  # a fork of the run's job server, or a fresh process and why
    env["triton_cache_dir"] = os.environ.get("TRITON_CACHE_DIR")
    if device == "cuda":
        index = torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        env["gpu_name"] = props.name
        env["gpu_memory_bytes"] = int(props.total_memory)
        env["gpu_multiprocessors"] = int(props.multi_processor_count)
        env["gpu_capability"] = f"{props.major}.{props.minor}"
        env["cuda_visible_devices"] = os.environ.get("CUDA_VISIBLE_DEVICES")
    else:
        env["gpu_name"] = None
    env["machine_key"] = machine_key(env)
    return env


def shapewise_variables():
    """The SHAPEWISE_* variables of this process, sorted by name."""
    return {name: value for name, value in sorted(os.environ.items()) if name.startswith("SHAPEWISE_")}


def machine_key(env):
    """What must match for timings to be comparable: the device model and the software."""
    hardware = env.get("gpu_name") or f"CPU {env.get('cpu')}"
    software = digest_of({k: env.get(k) for k in ("torch", "triton", "python", "driver", "packages_sha256")})
    return f"{hardware}{SOFTWARE_SEPARATOR}{software[:12]}"
