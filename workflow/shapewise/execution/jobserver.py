"""The job server of a pipeline run: every `shapewise job` of the run starts as a fork of one process that has
already imported torch, Triton and the job code, instead of importing them itself.

A fresh job process spends seconds before its first line of work (Python, torch, the model and kernel modules);
a fork of a process that did that once costs milliseconds. Each job is still a process of its own, with its own
output and log, and nothing of one job reaches another:
- the server imports modules and reads the static environment (shapewise.provenance.inventory.cheap_environment), and
  nothing else: it never initializes CUDA (CUDA does not survive a fork; `fork_problems` checks that torch did not
  initialize it, that the driver is not initialized, and that a fork of the server can initialize it), runs no
  kernel, and starts no thread;
- each job gets a fork of that same state, with the job's own stdin, stdout and stderr (passed over the socket),
  working directory, umask, environment, CPU affinity and torch thread count (what a fresh process takes from
  that environment), then runs it as a fresh process would (shapewise.execution.jobprocess): the GPU slot, the CPU
  pinning, `auto` resolved, the step;
- a job that crashes or is killed takes only its own process; the client (the process Snakemake started) waits
  for it to be gone, so its GPU memory and locks are released, before it returns the job's exit status;
- the client forwards SIGINT, SIGTERM and SIGHUP to the job, and a job whose client is gone kills itself;
- a job's log keeps at most LOG_HEAD_BYTES + LOG_TAIL_BYTES of its output (capped_output): the process Snakemake
  started, before it forks or runs the job, hands the job a pipe whose other end a small keeper process copies
  into the log, the first LOG_HEAD_BYTES at once, the last LOG_TAIL_BYTES when the output ends, and between them
  one line saying how many bytes were left out. Everything the job starts (a candidate's child) writes into the
  same pipe.

Which jobs use it: those of a local pipeline run (SHAPEWISE_PIPELINE_RUN, set by shapewise.execution.runs.begin in
the main Snakemake process: its host, pid and start time) on that run's host. A job SLURM placed, one run by hand,
or one whose run set SHAPEWISE_PIPELINE_JOB_SERVER=off starts fresh. The first job that finds no server starts
one (under a lock, so there is one per run and server key) and waits until it is ready; the server stops when the
run's Snakemake process is gone. A server that cannot be started, or refuses (the checks of `preload`), is
written down, and the run's jobs then start fresh, each saying why in its log and result
(`jobprocess.process_record`). A job whose device turns out other than the server's (`auto` on a node whose torch
sees no GPU) runs fresh.

There is one server per run, mode (cuda, or cpu with Triton's interpreter, which Triton reads when imported) and
environment (`server_key`: everything but the variables Snakemake sets per job).
"""

from __future__ import annotations

import atexit
import ctypes
import fcntl
import hashlib
import importlib
import json
import os
import pkgutil
import select
import signal
import socket
import stat
import struct
import subprocess
import sys
import threading
import time
import traceback
from collections import deque
from datetime import datetime

from shapewise.execution import gpushare, gpuslots, jobprocess
from shapewise.execution.jobprocess import RunFresh
from shapewise.inputs import paths, steps
from shapewise.provenance import inventory

RUN_VAR = "SHAPEWISE_PIPELINE_RUN"
OFF_VAR = "SHAPEWISE_PIPELINE_JOB_SERVER"  # "off": the run's jobs start as fresh processes
# Variables Snakemake sets per job (its thread count and temporary directory) and a shell's own: the job server
# of a run is the same whatever their values; each job's own values reach it with its environment.
PER_JOB_VARS = frozenset({"OMP_NUM_THREADS", "GOTO_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                          "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS", "TMPDIR", "TMP", "TEMP", "TEMPDIR",
                          "_", "PWD", "OLDPWD", "SHLVL"})
# The modules a server imports for its jobs: every step's module (shapewise.inputs.steps), every module of the model and
# of the kernels (the jobs import several of them where they are used), and what else the jobs import inside
# functions.
PACKAGES = ("shapewise.model", "shapewise.kernels")
MODULES = ("shapewise.inputs.manifest", "shapewise.provenance.identity", "shapewise.analysis.roofline",
           "shapewise.analysis.stats", "shapewise.execution.cpus", "shapewise.execution.gpushare", "torch.profiler",
           "triton.testing", "triton.runtime.autotuner", "triton.runtime.interpreter")
STATE_DIR = paths.ROOT / ".snakemake" / "shapewise-job-server"
START_TIMEOUT_S = 300  # the server's imports, on a loaded machine
GONE_TIMEOUT_S = 60  # a finished job's process tearing down its CUDA context
MAX_MESSAGE = 1 << 20
# Attempts of one job: each kernel choice a shared job meets runs it again (shapewise.execution.gpushare); a job meets a
# few.
MAX_ATTEMPTS = 12

# A job's log (capped_output): its first and last bytes. A job of shapewise writes kilobytes; a candidate may print
# without bound, and the beginning (what it is) and the end (how it failed) are what a reader needs.
LOG_HEAD_BYTES = 4 * 2**20
LOG_TAIL_BYTES = 4 * 2**20
LOG_DRAIN_S = 10  # after the job: how long the keeper may still copy output its leftover processes write


# ---- the run: who started it, is it still there ----------------------------------------------------------

def _start_ticks(pid):
    return gpuslots._start_ticks(pid)


def run_id():
    """This process as a pipeline run: host:pid:start ticks (shapewise.execution.runs.begin calls it in the main
    Snakemake process)."""
    return f"{socket.gethostname()}:{os.getpid()}:{_start_ticks(os.getpid())}"


def _parse_run(run):
    host, pid, ticks = run.rsplit(":", 2)
    return host, int(pid), int(ticks) if ticks != "None" else None


def run_alive(run):
    host, pid, ticks = _parse_run(run)
    return host == socket.gethostname() and _start_ticks(pid) == ticks


# ---- which server a job goes to -------------------------------------------------------------------------

def server_mode(device, environ=None):
    """The server a job of `device` forks from: "cpu" (Triton's interpreter) for --device cpu, or for auto in a
    run whose GPU pool is empty; "cuda" otherwise."""
    env = os.environ if environ is None else environ
    if device == "cpu" or (device == "auto" and not env.get(gpuslots.POOL_VAR)):
        return "cpu"
    return "cuda"


def server_environment(mode, environ=None):
    """The server's environment: the starting job's, without the per-job variables (torch's thread count
    defaults to what it is without them; each job sets its own, `_threads_of_a_fresh_process`)."""
    env = {k: v for k, v in (os.environ if environ is None else environ).items() if k not in PER_JOB_VARS}
    if mode == "cpu":
        env.setdefault("TRITON_INTERPRET", "1")  # as shapewise.cli does for a CPU job, before triton is imported
    return env


def server_key(mode, environ=None, cwd=None):
    """Digest of what a server's imports depend on: Python, the working directory, the mode and the environment
    without the per-job variables and without SHAPEWISE_* (the job's own arrive with it; the model reads them
    when it is built, not when imported)."""
    env = server_environment(mode, environ)
    kept = {k: v for k, v in env.items() if k not in PER_JOB_VARS and not k.startswith("SHAPEWISE_")}
    text = json.dumps({"python": sys.executable, "cwd": cwd or os.getcwd(), "mode": mode, "env": kept},
                      sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def _address(run, key):
    digest = hashlib.sha256(f"{run}|{key}".encode()).hexdigest()[:24]
    return "\0shapewise-job-server-" + digest  # an abstract socket: no file, gone with the server


def _state_paths(run, key):
    base = STATE_DIR / socket.gethostname()
    stem = hashlib.sha256(f"{run}|{key}".encode()).hexdigest()[:24]
    return {"lock": base / f"{stem}.start", "failed": base / f"{stem}.failed", "log": base / f"{stem}.log"}


def why_not(args, environ=None):
    """Why this job starts fresh instead of as a fork of the run's server, or None when it forks."""
    env = os.environ if environ is None else environ
    run = env.get(RUN_VAR)
    if not run:
        return "not a job of a pipeline run (no SHAPEWISE_PIPELINE_RUN)"
    if env.get(OFF_VAR) == "off":
        return f"{OFF_VAR}=off"
    slurm = env.get("SLURM_JOB_ID")
    if slurm and slurm != env.get(gpuslots.RUN_SLURM_VAR, ""):
        return "placed by SLURM"
    try:
        host = _parse_run(run)[0]
    except ValueError:
        return f"{RUN_VAR}={run!r} is not host:pid:ticks"
    if host != socket.gethostname():
        return f"the run's Snakemake runs on {host}, not here"
    if getattr(args, "device", None) is None:
        return "a job without a device"
    return None


# ---- messages: one JSON object per SOCK_SEQPACKET message ------------------------------------------------

def _send(sock, obj, fds=None):
    data = json.dumps(obj).encode()
    if fds:
        socket.send_fds(sock, [data], fds)
    else:
        sock.send(data)


def _recv(sock):
    data = sock.recv(MAX_MESSAGE)
    return json.loads(data) if data else None


def _log(message):
    print(f"[{datetime.now().strftime('%H:%M:%S')}] job process: {message}", file=sys.stderr, flush=True)


# ---- the client: the process Snakemake started ----------------------------------------------------------

def _connect(address):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.connect(address)
    except OSError:
        sock.close()
        return None
    return sock


def _start_server(run, mode, key, env):
    """Connect to the run's server, starting it first when there is none. Returns (socket, None) or (None, why)."""
    address, state = _address(run, key), _state_paths(run, key)
    sock = _connect(address)
    if sock is not None:
        return sock, None
    state["lock"].parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(state["lock"], os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # one starter; the others wait here, then connect
        sock = _connect(address)
        if sock is not None:
            return sock, None
        if state["failed"].is_file():
            return None, state["failed"].read_text().strip()
        with open(state["log"], "ab") as log:
            proc = subprocess.Popen([sys.executable, "-m", "shapewise.execution.jobserver", "serve", run, mode, key],
                                    env=server_environment(mode, env), stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=log, close_fds=True)
        line = proc.stdout.readline() if select.select([proc.stdout], [], [], START_TIMEOUT_S)[0] else b""
        proc.stdout.close()
        words = line.decode(errors="replace").strip()
        if words != "ready":
            if not words:
                status = proc.poll()
                words = f"no answer within {START_TIMEOUT_S} s" if status is None else f"exited ({status})"
                if status is None:
                    proc.kill()
            why = f"the job server did not start: {words} (its log: {state['log']})"
            state["failed"].write_text(why + "\n")
            return None, why
        sock = _connect(address)
        return (sock, None) if sock is not None else (None, "the job server started but takes no connection")
    finally:
        os.close(fd)


def _wait_gone(pid, ticks):
    """Wait until process `pid` (started at `ticks`) has ended: its GPU memory and locks are released then."""
    deadline = time.monotonic() + GONE_TIMEOUT_S
    while _start_ticks(pid) == ticks and ticks is not None:
        if time.monotonic() > deadline:
            _log(f"process {pid} still there {GONE_TIMEOUT_S} s after it finished; not waiting longer")
            return
        time.sleep(0.005)


def run(args, argv):
    """Run this job as a fork of the run's server: its exit status, or None when it is to run here, fresh (the
    reason is recorded by jobprocess.process_record)."""
    reason = why_not(args)
    if reason is not None:
        jobprocess.record_process(started_as="fresh process", reason=reason)
        return None
    run_name, mode = os.environ[RUN_VAR], server_mode(args.device)
    env = dict(os.environ)
    key = server_key(mode, env)
    forwarded = []
    for _ in range(MAX_ATTEMPTS):  # a fork, again holding the GPU alone for each kernel choice to time, or fresh
        sock, why = _start_server(run_name, mode, key, env)
        if sock is None:
            jobprocess.record_process(started_as="fresh process", reason=why)
            _log(f"starting fresh: {why}")
            return None
        try:
            request = {"argv": list(argv), "cwd": os.getcwd(), "env": env, "umask": _umask(),
                       "affinity": sorted(os.sched_getaffinity(0)), "mode": mode, "key": key,
                       "asked": time.time()}
            _send(sock, request, _std_fds())
            hello = _recv(sock)
            if hello is None:
                jobprocess.record_process(started_as="fresh process",
                                          reason="the job server closed the connection")
                _log("starting fresh: the job server closed the connection")
                return None
            pid, ticks = hello["pid"], hello["start_ticks"]
            old = _forward_signals(pid, forwarded)
            try:
                final = _recv(sock)
            finally:
                for signum, handler in old.items():
                    signal.signal(signum, handler)
        finally:
            sock.close()
        _wait_gone(pid, ticks)
        if final is None:
            _log(f"process {pid} ended without an exit status (crashed or killed)")
            return 128 + forwarded[-1] if forwarded else 1
        if "rc" in final:
            return final["rc"]
        if "restart" in final:
            env[gpuslots.USE_VAR] = gpuslots.EXCLUSIVE
            continue
        jobprocess.record_process(started_as="fresh process", reason=final["fresh"])
        return None
    _log(f"asked to run again holding its GPU alone {MAX_ATTEMPTS} times; giving up")
    return 1


def _std_fds():
    """stdin, stdout and stderr of this process for the job (/dev/null for one that is closed)."""
    fds = []
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
            fds.append(fd)
        except OSError:
            fds.append(os.open(os.devnull, os.O_RDWR))
    return fds


class capped_output:
    """A context in which this process's stdout and stderr (fds 1 and 2), and those of every process it starts,
    go through a pipe to a keeper process that writes the first `head` bytes into the log, keeps the last `tail`,
    and writes them after a line counting the bytes left out. Only where stdout and stderr are one regular file
    (the rule's `> {log} 2>&1`); a terminal or two files are left as they are. On leaving, fds 1 and 2 are the log
    again and the keeper finishes: at the end of the output, or LOG_DRAIN_S later, when a process the job left
    behind still holds the pipe (it then writes into a pipe nobody reads)."""

    def __init__(self, head=LOG_HEAD_BYTES, tail=LOG_TAIL_BYTES):
        self.head, self.tail = head, tail
        self.keeper = self.saved = None

    def __enter__(self):
        try:
            out, err = os.fstat(1), os.fstat(2)
        except OSError:
            return self
        if not (stat.S_ISREG(out.st_mode) and (out.st_dev, out.st_ino) == (err.st_dev, err.st_ino)):
            return self
        sys.stdout.flush()
        sys.stderr.flush()
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # the keeper: the log's only writer until the output ends
            code = 1
            try:
                os.close(write_end)
                _keep_log(read_end, 1, self.head, self.tail)
                code = 0
            finally:
                os._exit(code)
        os.close(read_end)
        self.keeper, self.saved = pid, os.dup(1)
        os.dup2(write_end, 1)
        os.dup2(write_end, 2)
        os.close(write_end)
        return self

    def __exit__(self, *exc):
        if self.keeper is None:
            return False
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os.dup2(self.saved, 1)  # this process's ends of the pipe closed: the keeper sees the end of the output
        os.dup2(self.saved, 2)
        os.close(self.saved)
        deadline = time.monotonic() + LOG_DRAIN_S
        while os.waitpid(self.keeper, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:
                os.kill(self.keeper, signal.SIGUSR1)  # a leftover process holds the pipe: write what was kept
                os.waitpid(self.keeper, 0)
                break
            time.sleep(0.02)
        self.keeper = None
        return False


class _Finish(Exception):
    """The keeper is told to stop reading (SIGUSR1)."""


def _keep_log(read_end, log, head, tail):
    """Copy `read_end` into `log` (file descriptors): the first `head` bytes as they come, then only the last `tail`
    bytes, written at the end of the input (or on SIGUSR1) after one line counting the bytes left out between."""
    def finish(_signum, _frame):
        raise _Finish

    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)  # a Ctrl-C or kill of the job's group: the job ends, its tail is kept
    signal.signal(signal.SIGUSR1, finish)
    written, kept, kept_bytes, dropped = 0, deque(), 0, 0
    try:
        while chunk := os.read(read_end, 1 << 16):
            if written < head:
                now = chunk[:head - written]
                _write_all(log, now)
                written += len(now)
                chunk = chunk[len(now):]
            if chunk:
                kept.append(chunk)
                kept_bytes += len(chunk)
                while kept_bytes - len(kept[0]) >= tail:
                    dropped += len(kept[0])
                    kept_bytes -= len(kept.popleft())
    except _Finish:
        pass
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    rest = b"".join(kept)
    if len(rest) > tail:
        dropped += len(rest) - tail
        rest = rest[len(rest) - tail:]
    if dropped:
        _write_all(log, f"\n[shapewise: {dropped} bytes of this job's output left out here; a job's log keeps its "
                        f"first {head} and last {tail} bytes]\n".encode())
    _write_all(log, rest)


def _write_all(fd, data):
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _forward_signals(pid, forwarded):
    def forward(signum, _frame):
        forwarded.append(signum)
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    return {signum: signal.signal(signum, forward) for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}


# ---- the server --------------------------------------------------------------------------------------

def preload(mode):
    """Import what the jobs need, and read the static environment once; return the reasons the state may not be
    forked (empty: it may)."""
    import torch  # deferred: the server imports torch when it starts serving, a job's client never

    for step in steps.STEPS.values():
        importlib.import_module(step.module)
    for package in PACKAGES:
        for info in pkgutil.iter_modules(importlib.import_module(package).__path__):
            importlib.import_module(f"{package}.{info.name}")
    for name in MODULES:
        importlib.import_module(name)
    inventory.cheap_environment()
    return fork_problems(torch.cuda.is_initialized(), mode)


def fork_problems(cuda_initialized, mode, probe=None):
    """What keeps this process's state from being forked into jobs: CUDA initialized by torch, more than one
    thread, and in the cuda mode the CUDA driver initialized already (loaded is harmless: libraries that link it
    load it) or a fork that cannot initialize it (`probe`, by default _cuda_driver_problem)."""
    problems = []
    if cuda_initialized:
        problems.append("torch initialized CUDA while importing")
    if threading.active_count() != 1:
        problems.append(f"{threading.active_count()} threads after importing (a fork keeps only one)")
    if mode == "cuda" and not problems:
        failure = (probe or _cuda_driver_problem)()
        if failure:
            problems.append(failure)
    return problems


CUDA_ERROR_NOT_INITIALIZED = 3  # what every driver call but cuInit returns before cuInit


def _cuda_driver_problem():
    try:
        maps = open("/proc/self/maps").read()
    except OSError as exc:
        return f"cannot read /proc/self/maps ({exc.strerror}) to see whether the CUDA driver is loaded"
    loaded = sorted({line.split()[-1] for line in maps.splitlines() if "libcuda.so" in line.rsplit("/", 1)[-1]})
    if loaded:  # loaded by a library that links it (CUPTI, Triton's driver module): harmless until initialized
        problem = _initialized_driver_problem(loaded[0])
        if problem:
            return problem
    return _cuda_init_in_a_fork()


def _initialized_driver_problem(library, device_count_status=None):
    """None while the loaded CUDA driver `library` is not initialized (cuDeviceGetCount, which initializes nothing,
    answers CUDA_ERROR_NOT_INITIALIZED), else why it is."""
    if device_count_status is None:
        count = ctypes.c_int()
        try:
            device_count_status = ctypes.CDLL(library).cuDeviceGetCount(ctypes.byref(count))
        except (OSError, AttributeError) as exc:
            return f"cannot ask the loaded CUDA driver {library} whether it is initialized ({exc})"
    if device_count_status != CUDA_ERROR_NOT_INITIALIZED:
        return (f"the CUDA driver was initialized while importing (cuDeviceGetCount returned {device_count_status}, "
                f"not {CUDA_ERROR_NOT_INITIALIZED}: not initialized)")
    return None


def _cuda_init_in_a_fork():
    """None when a fork of this process initializes the CUDA driver (cuInit, which creates no context and uses
    no GPU memory), else why not."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            status = ctypes.CDLL("libcuda.so.1").cuInit(0)
            message = "" if status == 0 else f"cuInit returned {status} in a fork"
        except OSError as exc:
            message = f"no CUDA driver to initialize in a fork ({exc})"
        os.write(write, message.encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as fh:
        message = fh.read().decode()
    os.waitpid(pid, 0)
    return message or None


def serve(run, mode, key):
    os.setsid()  # out of the starting job's process group: Snakemake ending that job ends not the server
    problems = preload(mode)
    if problems:
        print("refused: " + "; ".join(problems), flush=True)
        return 2
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        listener.bind(_address(run, key))
    except OSError as exc:
        print(f"refused: cannot listen ({exc.strerror})", flush=True)
        return 2
    listener.listen(64)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the jobs
    started = datetime.now().astimezone().isoformat(timespec="milliseconds")
    print("ready", flush=True)
    os.dup2(2, 1)  # the starting client stops reading: nothing more goes to its pipe
    _log(f"job server {os.getpid()} for run {run} ({mode}) ready")
    while run_alive(run):
        if not select.select([listener], [], [], 1.0)[0]:
            continue
        try:
            conn, _ = listener.accept()
        except OSError:
            continue
        peer_uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                       struct.calcsize("3i")))[1]
        if peer_uid != os.getuid():  # the socket is reachable by any user of this network namespace
            conn.close()
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        forked = time.time()
        if os.fork() == 0:
            try:
                _child(conn, listener, {"server_pid": os.getppid(), "server_started": started, "server_key": key,
                                        "mode": mode, "forked": forked})
            finally:
                os._exit(70)  # never back into the server's loop
        conn.close()
    _log(f"job server {os.getpid()}: run {run} is gone, stopping")
    return 0


def _child(conn, listener, server):
    """A job: the fork of the server, made into the client's process, running the job (jobprocess.run_forked)."""
    listener.close()
    for signum in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    atexit._clear()  # the server's exit handlers are not the job's (private: docs/decisions.md, private-apis)
    os.setsid()
    data, fds, _, _ = socket.recv_fds(conn, MAX_MESSAGE, 3)
    request = json.loads(data)
    for target, fd in zip((0, 1, 2), fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.umask(request["umask"])
    os.environ.clear()
    os.environ.update(request["env"])
    os.sched_setaffinity(0, request["affinity"])
    sys.argv = [sys.argv[0]] + request["argv"]
    _threads_of_a_fresh_process()
    _send(conn, {"pid": os.getpid(), "start_ticks": _start_ticks(os.getpid())})
    threading.Thread(target=_watch_client, args=(conn,), daemon=True).start()
    jobprocess.record_process(started_as="fork of the job server", **{k: v for k, v in server.items() if k != "forked"},
                   fork_s=round(time.time() - request["asked"], 4))
    _log(f"pid {os.getpid()}, forked from the job server (pid {server['server_pid']}) in "
         f"{jobprocess.process_record()['fork_s'] * 1e3:.0f} ms")
    final = None
    try:
        rc = jobprocess.run_forked(request["argv"], request["mode"])
    except SystemExit as exc:
        rc = _exit_status(exc.code)
    except RunFresh as exc:
        final, rc = {"fresh": str(exc)}, 0
        _log(f"runs fresh: {exc}")
    except gpushare.NeedsExclusiveGPU as exc:
        final, rc = {"restart": str(exc)}, 0
        _log(f"runs again holding its GPU alone: {exc}")
    except BaseException:  # a job's crash ends its own process only, with its traceback in its log
        traceback.print_exc()
        rc = 1
    if final is None:
        rc = rc if isinstance(rc, int) else _exit_status(rc)
        atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    _send(conn, final or {"rc": rc})
    os._exit(rc if final is None else 0)


def _threads_of_a_fresh_process():
    """torch's thread count as a fresh process would take it from the job's environment (OMP_NUM_THREADS, else
    MKL_NUM_THREADS; neither: torch's default, as in the server, whose environment has neither)."""
    import torch  # deferred: a job's client imports this module and never torch

    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        value = os.environ.get(name, "").strip()
        if value.isdigit() and int(value) > 0:
            torch.set_num_threads(int(value))
            return


def _exit_status(code):
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _watch_client(conn):
    """The job's other thread: a client that is gone (killed with SIGKILL, which it cannot forward) ends the job."""
    try:
        while conn.recv(MAX_MESSAGE):
            pass
    except OSError:
        pass
    os.kill(os.getpid(), signal.SIGKILL)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 4 or argv[0] != "serve":
        print("usage: python -m shapewise.execution.jobserver serve RUN MODE KEY (started by `shapewise job`)",
              file=sys.stderr)
        return 2
    return serve(*argv[1:])


if __name__ == "__main__":  # run the package's module, so the jobs see one shapewise.execution.jobserver
    from shapewise.execution import jobserver

    raise SystemExit(jobserver.main())
