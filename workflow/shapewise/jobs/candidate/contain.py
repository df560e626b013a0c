"""Containing a candidate's child process (docs/candidates.md, the trust model): what it starts ends with the job,
what it writes stays in directories of its own, and what it prints is capped in the job's log.

- processes (`Contained`, in the job process): the job process is a child subreaper (prctl
  PR_SET_CHILD_SUBREAPER), so a process the candidate starts in a new session stays this process's descendant
  when its parent ends; when the child ends (or the job ends it: done, a time limit, SIGTERM), `end_descendants`
  kills every process whose parent chain leads to the job process, until none is left, and reaps them. The job
  process starts no process of its own while its candidate's child lives, so every descendant then is the
  candidate's.
- writes (`plan` in the job process, `confine` in the child, after its own set-up and before the candidate is
  imported): a Landlock domain that lets the child and everything it starts write only under its scratch
  directory (its progress file, each handed-over output, a profile's files: the job process reads or copies them
  from there), its candidate's compile caches (Triton, Inductor, CUDA: `.snakemake/candidate-cache/<name>`, shared
  by that candidate's jobs and by no other model's) and /dev (the GPU's device files, /dev/null, /dev/shm); a write
  anywhere else (results/, the report, the checkout) fails with EACCES. On a kernel with Landlock's signal scope
  (ABI 6) it cannot signal a process outside its domain either (the job process, the run's other jobs). Where the
  kernel offers no Landlock, or config pass_env sets SHAPEWISE_CANDIDATE_CONFINE=off, the child runs unconfined,
  and the result's `containment` and the report say so.
- output (`LogCap`, in the job process): the child's standard output and error go through a pipe into the job's
  log, the first LOG_HEAD_BYTES as they come and the last LOG_TAIL_BYTES at the end, with a line saying how many
  bytes between them were dropped.

Not contained: the network, reads (the child reads what the user may read), CPU and memory beyond the job's time
limit and pinning, and a job process killed with SIGKILL (its descendants then outlive it: a subreaper ends them
only while it lives).
"""

from __future__ import annotations

import collections
import ctypes
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38
# Landlock's system calls have these numbers on every Linux architecture.
SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446
LANDLOCK_CREATE_RULESET_VERSION = 1 << 0
LANDLOCK_RULE_PATH_BENEATH = 1
LANDLOCK_SCOPE_SIGNAL = 1 << 1  # ABI 6
# The filesystem rights that write, by the ABI that introduced them: handling exactly these leaves reads, execution
# and device ioctls as they are, and denies every kind of write outside the allowed directories.
WRITE_RIGHTS = {
    1: ((1 << 1)  # WRITE_FILE
        | (1 << 4) | (1 << 5)  # REMOVE_DIR, REMOVE_FILE
        | (1 << 6) | (1 << 7) | (1 << 8) | (1 << 9) | (1 << 10) | (1 << 11) | (1 << 12)),  # MAKE_CHAR .. MAKE_SYM
    2: 1 << 13,  # REFER: links and renames across directories
    3: 1 << 14,  # TRUNCATE
}
SWITCH = "SHAPEWISE_CANDIDATE_CONFINE"  # "off": run the candidate's child unconfined (recorded as such)
CACHE_ROOT = Path(".snakemake") / "candidate-cache"  # under the run's working directory, one per candidate
CACHE_VARIABLES = {"TRITON_CACHE_DIR": "triton", "TORCHINDUCTOR_CACHE_DIR": "inductor", "CUDA_CACHE_PATH": "cuda"}
LOG_HEAD_BYTES = LOG_TAIL_BYTES = 4 << 20  # a candidate's log keeps at most 8 MiB of what its child printed
END_WAIT_S = 10.0  # how long end_descendants keeps killing before it gives up naming the survivors


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    libc.prctl.restype = ctypes.c_int
    return libc


# ------------------------------------------------------------------ processes


def become_subreaper() -> bool:
    """Make this process the reaper of its orphaned descendants; whether the kernel agreed."""
    if not sys.platform.startswith("linux"):
        return False
    return _libc().prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def _parents():
    """{pid: parent pid} of every process /proc shows now."""
    found = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            parent = _parent(int(entry.name))
            if parent is not None:
                found[int(entry.name)] = parent
    return found


def _parent(pid):
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except OSError:
        return None
    return int(stat.rpartition(b")")[2].split()[1])  # after the name, which may hold ")": state, ppid


def descendants(root=None) -> list[int]:
    """The processes whose parent chain leads to `root` (this process), parents before their children."""
    root = os.getpid() if root is None else root
    children = collections.defaultdict(list)
    for pid, parent in _parents().items():
        children[parent].append(pid)
    found, queue = [], [root]
    while queue:
        for child in children.pop(queue.pop(0), []):
            found.append(child)
            queue.append(child)
    return found


def _kill(pid, mine):
    """SIGKILL `pid` if it is still a descendant (its parent in `mine`): a pidfd taken before that check keeps a
    number reused since from being signalled."""
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return
    try:
        if _parent(pid) in mine:
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    except OSError:
        pass
    finally:
        os.close(pidfd)


def end_descendants(wait_s=END_WAIT_S) -> dict:
    """Kill every descendant of this process and reap those that became its children, until none is left (one
    that forks while being killed leaves an orphan, which comes back here). Returns {"ended": how many were
    found, "left": the pids still there after `wait_s` seconds}."""
    me = os.getpid()
    seen = set()
    deadline = time.monotonic() + wait_s
    while True:
        found = descendants(me)
        seen.update(found)
        mine = {me, *found}
        for pid in found:
            _kill(pid, mine)
        for pid in found:  # a zombie child of this process is reaped here; others' by their parents or here later
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
        if not found or time.monotonic() > deadline:
            return {"ended": len(seen), "left": found}
        time.sleep(0.01)


# ------------------------------------------------------------------ writes


def landlock_abi() -> int:
    """The kernel's Landlock ABI version; 0 where it offers none (not Linux, not built in, or disabled)."""
    if not sys.platform.startswith("linux"):
        return 0
    version = _libc().syscall(SYS_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0),
                              ctypes.c_uint32(LANDLOCK_CREATE_RULESET_VERSION))
    return max(0, int(version))


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def write_rights(abi) -> int:
    rights = 0
    for since, bits in WRITE_RIGHTS.items():
        if abi >= since:
            rights |= bits
    return rights


def plan(writable, environ=None) -> dict:
    """The job process's decision for its child: {"writes": "landlock", "abi", "writable"} (the directories the
    child may write under), or {"writes": "unconfined", "reason"}."""
    environ = os.environ if environ is None else environ
    if environ.get(SWITCH, "").lower() == "off":
        return {"writes": "unconfined", "reason": f"{SWITCH}=off (config pass_env)"}
    abi = landlock_abi()
    if abi < 1:
        return {"writes": "unconfined", "reason": "this kernel offers no Landlock (landlock_create_ruleset: "
                f"{os.strerror(ctypes.get_errno()) if sys.platform.startswith('linux') else 'not Linux'})"}
    return {"writes": "landlock", "abi": abi, "writable": [str(Path(p).resolve()) for p in writable]}


def confine(decided):
    """In the child, before the candidate's code runs: restrict this process and everything it starts to writing
    under decided["writable"] (a `plan`); nothing where the plan is unconfined. Raises OSError naming the step
    that failed."""
    if decided["writes"] != "landlock":
        return
    libc = _libc()
    abi = min(int(decided["abi"]), landlock_abi())
    rights = write_rights(abi)
    attr = _RulesetAttr(rights, 0, LANDLOCK_SCOPE_SIGNAL if abi >= 6 else 0)
    size = ctypes.sizeof(ctypes.c_uint64) * (3 if abi >= 6 else 2 if abi >= 4 else 1)
    ruleset = libc.syscall(SYS_LANDLOCK_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size),
                           ctypes.c_uint32(0))
    if ruleset < 0:
        raise _errno("landlock_create_ruleset")
    try:
        for path in decided["writable"]:
            fd = os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                rule = _PathBeneathAttr(rights, fd)
                if libc.syscall(SYS_LANDLOCK_ADD_RULE, ctypes.c_int(ruleset), ctypes.c_int(LANDLOCK_RULE_PATH_BENEATH),
                                ctypes.byref(rule), ctypes.c_uint32(0)) != 0:
                    raise _errno(f"landlock_add_rule {path}")
            finally:
                os.close(fd)
        if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise _errno("prctl(PR_SET_NO_NEW_PRIVS)")
        if libc.syscall(SYS_LANDLOCK_RESTRICT_SELF, ctypes.c_int(ruleset), ctypes.c_uint32(0)) != 0:
            raise _errno("landlock_restrict_self")
    finally:
        os.close(ruleset)


def _errno(what):
    err = ctypes.get_errno()
    return OSError(err, f"{what}: {os.strerror(err)}")


# ------------------------------------------------------------------ output


class LogCap:
    """Copies what arrives on `read_fd` to `out_fd` (the job's log) in a thread: the first `head` bytes as they
    come, then only the last `tail` bytes, written with a line saying how many were dropped when `close` is
    called (after every writer of the pipe is gone)."""

    def __init__(self, read_fd, out_fd=1, head=LOG_HEAD_BYTES, tail=LOG_TAIL_BYTES):
        self.read_fd, self.out_fd, self.head, self.tail = read_fd, out_fd, head, tail
        self.total = 0
        self.kept = collections.deque()  # the tail, in chunks
        self.kept_bytes = 0
        self.thread = threading.Thread(target=self._copy, daemon=True)
        self.thread.start()

    def _write(self, data):
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(self.out_fd, view):]
            except OSError:  # the log is gone: what the child prints is dropped, the job goes on
                return

    def _copy(self):
        while True:
            try:
                chunk = os.read(self.read_fd, 1 << 16)
            except OSError:
                return
            if not chunk:
                return
            room = max(0, self.head - self.total)
            self.total += len(chunk)
            if room:
                self._write(chunk[:room])
                chunk = chunk[room:]
            if chunk:
                self.kept.append(chunk)
                self.kept_bytes += len(chunk)
                while self.kept_bytes - len(self.kept[0]) >= self.tail:
                    self.kept_bytes -= len(self.kept.popleft())

    def close(self, wait_s=END_WAIT_S) -> dict:
        """Write the kept tail; {"bytes": what the child printed, "dropped_bytes"}."""
        self.thread.join(wait_s)
        os.close(self.read_fd)
        tail = b"".join(self.kept)[-self.tail:] if self.kept else b""
        dropped = self.total - min(self.total, self.head) - len(tail)
        if dropped:
            self._write(f"\n[shapewise: {dropped} bytes of the candidate's output dropped here: its log keeps the "
                        f"first {self.head} and the last {self.tail} bytes]\n".encode())
        self._write(tail)
        return {"bytes": self.total, "dropped_bytes": dropped}


# ------------------------------------------------------------------ the job process's side


class Contained:
    """What the job process sets up around one candidate child, and ends with it: the subreaper, the child's
    scratch directory and compile caches, the plan for its writes, the pipe of its output. `child_fields` go into
    the child's arguments and `environ` is its environment; `end` (once the child is finished) ends its
    descendants, removes the scratch directory and returns the result's `containment` record."""

    def __init__(self, candidate):
        self.subreaper = become_subreaper()
        self.scratch = Path(tempfile.mkdtemp(prefix=f"shapewise-candidate-{candidate}-")).resolve()
        (self.scratch / "tmp").mkdir()
        cache = (CACHE_ROOT / candidate).resolve()
        self.environ = dict(os.environ, TMPDIR=str(self.scratch / "tmp"))
        for variable, sub in CACHE_VARIABLES.items():
            (cache / sub).mkdir(parents=True, exist_ok=True)
            self.environ[variable] = str(cache / sub)
        self.decided = plan([self.scratch, cache, "/dev"])
        self.log_read, self.log_write = os.pipe()
        self.log = None
        self.record = None

    def child_fields(self):
        """The child's arguments for its containment: where it writes, how it confines itself, its output's pipe."""
        return {"scratch": str(self.scratch), "confine": self.decided, "log_fd": self.log_write}

    def started(self):
        """After the child started: its output's pipe is its own (and its descendants')."""
        os.close(self.log_write)
        self.log_write = None
        self.log = LogCap(self.log_read)

    def end(self) -> dict:
        if self.record is not None:
            return self.record
        ended = end_descendants()
        if self.log_write is not None:
            os.close(self.log_write)
        log_record = self.log.close() if self.log is not None else {"bytes": 0, "dropped_bytes": 0}
        self.record = {"processes": "subreaper" if self.subreaper else "process group only (no subreaper)",
                       "descendants_ended": ended["ended"], "descendants_left": ended["left"],
                       **self.decided, "log": log_record}
        return self.record

    def remove(self):
        """Remove the scratch directory (after `end`: nothing writes there any more)."""
        shutil.rmtree(self.scratch, ignore_errors=True)


def adopt_log(fd):
    """In the child, first: its standard output and error go into the job process's pipe (`LogCap`)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
