"""A candidate's jobs (config `candidates`; shapewise.candidates owns the names, paths, digests and isolation).

The trust model: a candidate's code runs only in a child process (`python -m shapewise.jobs.candidate`), which the
job process (`shapewise job candidate-<step>`, holding the GPU slot and the CPU pinning) starts under the job's
time limit after checking that the candidate's files still have the digest the DAG was built with. The job
process never imports the candidate and takes nothing from the child but JSON and plain tensor bytes, so nothing
the candidate does to torch or to shapewise in its own process (a function patched, a global flag set, an input
written in place) reaches the reference it is judged against.

- accuracy and timing (`drive`): the job process builds the reference itself, draws the reference's inputs from
  their seeds itself, and writes the result. It asks the child, one JSON line each way over a pipe pair
  (`CandidateProcess`, `serve`), to build the candidate and to run it: for accuracy the child hands each trial's
  output over as plain tensor data (`write_plain`: dtype, shape and raw bytes in a file; `read_plain` makes a
  tensor of them here) and the job process compares it with the reference; for timing the job process runs the
  protocol, the reference's rounds in its own process and the candidate's in the child, alternating on the same
  device.
- profile (`supervise`): no reference; the child captures the candidate and writes the result.

The child is contained (`contain`): the job process is its subreaper and ends every process it started with it,
the child confines its writes (Landlock) to its scratch directory, where it writes its progress, each handed-over
output and a profile's files, before it imports the candidate, and its output is capped in the job's log.

Whatever the candidate does wrong in the child (import, constructor, weights, forward) is caught there and answered
as the row's failure (`CandidateFailed`); its output is checked there for type (a plain dense torch.Tensor, no
subclass), shape, dtype, device, memory shared with its previous output and writes into its input, and the
output's dtype, shape and size again here. When the child hangs past the time limit or dies (a signal, an exit of
the candidate's own), the job process writes the failure from the child's progress file: the stage it had reached.
Either way the job ends with a result and exit code 0, so the rest of the DAG and the report go on; only a failure
of the harness itself (outside the candidate's code) fails the job.

A candidate is built like shapewise's model: the reference's weights (BaselineTransformer(config) after
torch.manual_seed(0), jobs.models.seeded_reference, made before the candidate is imported), the candidate
constructed with that config (shapewise.model.TransformerConfig, the seven contract fields), the reference's
state_dict loaded strictly, else non-strictly with the missing and unexpected keys recorded, then moved to the
row's dtype and device.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import stat
import sys
import time
import traceback
from pathlib import Path

import torch

from shapewise import candidates
from shapewise.execution import cpus, gpuslots, jobprocess
from shapewise.jobs import preflight
from shapewise.jobs.candidate.contain import Contained, confine
from shapewise.jobs.device import free_memory_bytes, setup
from shapewise.jobs.inputs import DTYPES
from shapewise.jobs.io import header, log, write_result
from shapewise.jobs.models import seeded_reference

TRACEBACK_LINES = 12  # the last lines of a candidate's traceback kept in its failure record
REPLY_LIMIT_BYTES = 1 << 20  # the longest answer of the child the job process reads (a JSON line)
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


class CandidateFailed(Exception):
    """The candidate failed the row: kind (shapewise.candidates.FAILURES), stage, message."""

    def __init__(self, kind, stage, message, trace=None):
        super().__init__(f"{kind} at {stage}: {message}")
        self.kind, self.stage, self.message, self.trace = kind, stage, message, trace

    def record(self):
        return failure(self.kind, self.stage, self.message, self.trace)


def failure(kind, stage, message, trace=None):
    if kind not in candidates.FAILURES:
        raise ValueError(f"unknown candidate failure kind {kind!r}; kinds are {sorted(candidates.FAILURES)}")
    return {"kind": kind, "what": candidates.FAILURES[kind], "stage": stage, "message": message,
            "traceback": trace}


def guarded(stage, fn, *args):
    """fn(*args), the candidate's own code: anything it raises (SystemExit included) becomes CandidateFailed."""
    try:
        return fn(*args)
    except CandidateFailed:
        raise
    except (Exception, SystemExit) as exc:
        lines = traceback.format_exception(exc)
        trace = "".join(lines).splitlines()[-TRACEBACK_LINES:]
        raise CandidateFailed(candidates.classify(exc, stage), stage, f"{type(exc).__name__}: {exc}",
                              trace) from exc


def beside(stage, fn, *args):
    """fn(*args), the harness's own code run beside the candidate (the reference, while the candidate's process
    holds its memory on the same device): a failed allocation there is the candidate's out-of-memory failure (the
    memory the candidate holds counts against the reference's); anything else it raises is the harness's own
    error."""
    try:
        return fn(*args)
    except Exception as exc:
        if candidates.is_out_of_memory(exc):
            raise CandidateFailed("out-of-memory", stage, "the reference ran out of memory beside the candidate: "
                                  f"{type(exc).__name__}: {exc}") from exc
        raise


# ------------------------------------------------------------------ progress, read by the job process


def progress_path(out):
    return f"{out}.progress"


class Progress:
    """The child's progress file: the stage it is in, rewritten when it changes (and, for a step whose child writes
    the result, that result's header, written before the candidate is imported); removed once the result is
    written."""

    def __init__(self, path):
        self.path = Path(path)
        self.state = self.initial()
        self.result = None  # the result being filled in, once begun (a step whose child writes it)

    @staticmethod
    def initial():
        """The state before the child's first stage (also what the job process assumes of a child that wrote none)."""
        return {"header": None, "stage": "setup", "candidate_code": False}

    def begin(self, result):
        self.result = result
        self.state["header"] = {k: v for k, v in result.items() if not k.startswith("_")}
        self._write()

    def stage(self, name, candidate_code=True):
        """Enter stage `name`; candidate_code: whether the candidate's code runs in it (a hang or a death there is
        the candidate's failure; elsewhere a death is the harness's own error)."""
        if (self.state["stage"], self.state["candidate_code"]) == (name, candidate_code):
            return
        self.state.update(stage=name, candidate_code=candidate_code)
        log(f"stage: {name}")
        self._write()

    def _write(self):
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.state, default=str))
        os.replace(tmp, self.path)

    def done(self):
        self.path.unlink(missing_ok=True)


def read_progress(path):
    """The child's last progress state, or the initial one where it wrote none (or nothing readable)."""
    try:
        state = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return Progress.initial()
    if not isinstance(state, dict) or not isinstance(state.get("stage"), str):
        return Progress.initial()
    return dict(Progress.initial(), **state)


def begin(step, row, args, progress):
    """The result's header with the candidate's record, handed to `progress` first."""
    result = header(step, row, args.device, args)
    result["candidate"] = describe(args)
    progress.begin(result)
    return result


def describe(args):
    """{"name", "path", "layout", "sha256", "files"} of the job's candidate (its digest is the job's
    --impl-digest, checked by `check_digest`)."""
    full = candidates.location(args.candidate_path)
    return {"name": args.candidate, "path": args.candidate_path, "layout": "package" if full.is_dir() else "file",
            "sha256": args.impl_digest, "files": candidates.files(args.candidate_path)}


# ------------------------------------------------------------------ the candidate (in the child)


def build(args, row, config, device, progress):
    """(candidate, weights record): the reference's weights made before any candidate code runs in this process,
    then the candidate imported, constructed, given them, and moved to the row's dtype and device."""
    progress.stage("reference weights", candidate_code=False)
    state = seeded_reference(config).state_dict()
    progress.stage("confine", candidate_code=False)
    try:
        confine(args.confine)
    except OSError as exc:
        raise SystemExit(f"candidate {args.candidate}: cannot confine its process's writes: {exc}") from None
    progress.stage("import")
    cls = guarded("import", candidates.load_class, args.candidate_path, args.candidate)
    progress.stage("construct")
    model = guarded("construct", cls, config)
    progress.stage("weights")
    weights = guarded("weights", load_weights, model, state)
    model = guarded("weights", lambda: model.to(device=device, dtype=DTYPES[row["dtype"]]).eval())
    return model, weights


def load_weights(model, state):
    """Load the reference's weights: strictly, else non-strictly (a candidate with parameters of its own or
    without some of the reference's). Returns {"strict", "missing_keys", "unexpected_keys", "strict_error"}."""
    try:
        model.load_state_dict(state, strict=True)
        return {"strict": True, "missing_keys": [], "unexpected_keys": [], "strict_error": None}
    except RuntimeError as exc:
        strict_error = " ".join(str(exc).split())
    loaded = model.load_state_dict(state, strict=False)  # a shape mismatch raises here too: the weights stage fails
    log(f"weights loaded non-strictly: {len(loaded.missing_keys)} missing, {len(loaded.unexpected_keys)} "
        f"unexpected keys")
    return {"strict": False, "missing_keys": list(loaded.missing_keys),
            "unexpected_keys": list(loaded.unexpected_keys), "strict_error": strict_error}


def call(model, x, mask):
    """The row's call: model(x, valid_token_mask), or model(x) where the row passes no mask."""
    return model(x) if mask is None else model(x, mask)


def forward(model, x, mask, stage, previous=None):
    """One checked call of the candidate (under the caller's inference mode)."""
    version = x._version
    out = guarded(stage, call, model, x, mask)
    check_output(out, x, stage, version, previous)
    return out


def check_output(out, x, stage, version, previous=None):
    """Raise CandidateFailed unless `out` is a plain dense torch.Tensor (no subclass: a subclass decides what any
    operation on it computes, the comparison's included) of x's shape, dtype and device, x was not written (its
    version counter, which counts PyTorch's in-place writes), and `out` shares no memory with `previous` (the
    candidate's previous output, which the caller still holds)."""
    if not isinstance(out, torch.Tensor):
        raise CandidateFailed("wrong-output", stage, f"returned a {type(out).__name__}, expected a tensor")
    if type(out) is not torch.Tensor:
        kind = type(out)
        raise CandidateFailed("wrong-output", stage, f"returned a {kind.__module__}.{kind.__qualname__}, a "
                              "torch.Tensor subclass: only a plain torch.Tensor is accepted")
    if out.layout != torch.strided or out.is_nested:
        raise CandidateFailed("wrong-output", stage, f"returned a {'nested' if out.is_nested else out.layout} "
                              "tensor: only a dense (torch.strided) tensor is accepted")
    wrong = [f"{what} {got} (expected {want})" for what, got, want in
             (("shape", tuple(out.shape), tuple(x.shape)), ("dtype", out.dtype, x.dtype),
              ("device", out.device, x.device)) if got != want]
    if wrong:
        raise CandidateFailed("wrong-output", stage, "returned " + ", ".join(wrong))
    if x._version != version:
        raise CandidateFailed("modified-input", stage, "wrote into its input x in place")
    if previous is not None and shares_memory(out, previous):
        raise CandidateFailed("aliased-output", stage,
                              "its output shares memory with its previous output, which the caller still holds "
                              "(a buffer reused across calls overwrites that output)")


def shares_memory(a, b):
    """Whether the storages of two tensors overlap."""
    if a.device != b.device:
        return False
    sa, sb = a.untyped_storage(), b.untyped_storage()
    if sa.nbytes() == 0 or sb.nbytes() == 0:
        return False
    pa, pb = sa.data_ptr(), sb.data_ptr()
    return pa < pb + sb.nbytes() and pb < pa + sa.nbytes()


@torch.inference_mode()
def host_copy(out):
    """A plain contiguous CPU tensor holding `out`'s values (a checked output: check_output)."""
    host = torch.empty(tuple(out.shape), dtype=out.dtype)
    host.copy_(out)
    return host


def write_plain(host, path):
    """Hand a host_copy over as plain tensor data: its raw bytes into `path`; returns {"dtype", "shape"}, the rest
    of the data (read_plain reads it back in the job process)."""
    with open(path, "wb") as fh:
        fh.write(memoryview(host.reshape(-1).view(torch.uint8).numpy()))
    return {"dtype": DTYPE_NAMES.get(host.dtype, str(host.dtype)), "shape": list(host.shape)}


def serve(args, handlers):
    """The child's body in a step the job process drives (`drive`): answer each request (a JSON line
    {"op", ...} on the channel's first descriptor) on the second with {"ok": handlers[op](request, progress)}, or
    {"failed": record} where the candidate failed, and then end; end too when the job process closes its end."""
    progress = Progress(progress_path(args.out))
    commands_fd, replies_fd = args.channel
    with os.fdopen(commands_fd, "r") as commands, os.fdopen(replies_fd, "w") as replies:
        for line in commands:
            request = json.loads(line)
            try:
                answer = {"ok": handlers[request["op"]](request, progress)}
            except CandidateFailed as failed:
                log(f"{args.candidate}: FAILED {failed}")
                answer = {"failed": failed.record()}
            replies.write(json.dumps(answer) + "\n")
            replies.flush()
            if "failed" in answer:
                break
    return 0


def run_step(work, args, outputs_on_failure=None):
    """The child's body in a step whose child writes the result (`supervise`): `work(args, progress)` writes it; a
    CandidateFailed it lets through is written as the row's failure into the result it began (with
    outputs_on_failure(args, note) writing the step's other outputs)."""
    progress = Progress(progress_path(args.out))
    try:
        work(args, progress)
    except CandidateFailed as failed:
        if progress.result is None:
            raise
        log(f"{args.candidate}: FAILED {failed}")
        progress.result.update(status="fail", failure=failed.record())
        if outputs_on_failure is not None:
            outputs_on_failure(args, f"the candidate failed: {failed}")
        write_result(args.out, progress.result)
    progress.done()
    return 0


# ------------------------------------------------------------------ the job process


def reference_fit(config, device, headroom):
    """Whether the plain reference fits, as the preflight job decides it: its estimated peak (float32) against the
    free device memory (a GPU) or available RAM (a CPU) times the headroom, read before anything is allocated."""
    budget = preflight.budget_bytes(free_memory_bytes(device)[0], headroom)
    estimate, fits = preflight.reference_fit(config, budget)
    return {"fits": fits, "estimate_bytes": estimate, "budget_bytes": budget, "headroom": headroom,
            "reason": None if fits else f"resource skip: estimated {estimate} bytes > budget {budget} bytes"}


def read_plain(path, handed, shape, dtype_name, stage):
    """The output the child handed over (write_plain) as a tensor made here: `handed` must name `dtype_name` and
    `shape`, and `path` be a regular file of exactly their size in bytes; anything else is the candidate's
    wrong-output failure, named."""
    what = f"the plain tensor data its process handed over ({path})"
    if not (isinstance(handed, dict) and handed.get("dtype") in DTYPES and isinstance(handed.get("shape"), list)
            and all(type(n) is int and n >= 0 for n in handed["shape"])):
        raise CandidateFailed("wrong-output", stage, f"{what}: no dtype and shape but {str(handed)[:200]}")
    if handed["dtype"] != dtype_name or tuple(handed["shape"]) != tuple(shape):
        raise CandidateFailed("wrong-output", stage, f"{what}: dtype {handed['dtype']} shape {tuple(handed['shape'])}"
                              f" (expected {dtype_name} {tuple(shape)})")
    dtype = DTYPES[dtype_name]
    size = dtype.itemsize
    for n in shape:
        size *= n
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        raise CandidateFailed("wrong-output", stage, f"{what}: cannot be opened: {exc.strerror}") from None
    with os.fdopen(fd, "rb", buffering=0) as fh:
        found = os.fstat(fh.fileno())
        if not stat.S_ISREG(found.st_mode) or found.st_size != size:
            raise CandidateFailed("wrong-output", stage, f"{what}: not a regular file of {size} bytes "
                                  f"({found.st_size} bytes)")
        data = bytearray(size)
        view, done = memoryview(data), 0
        while done < size:
            n = fh.readinto(view[done:])
            if not n:
                raise CandidateFailed("wrong-output", stage, f"{what}: ended after {done} of {size} bytes")
            done += n
    if size == 0:
        return torch.empty(tuple(shape), dtype=dtype)
    return torch.frombuffer(data, dtype=torch.uint8).view(dtype).reshape(tuple(shape))


class ChildEnded(Exception):
    """The candidate's child ended, or ran past the time limit, before it answered: `outcome` is
    shapewise.candidates.Isolated.finish's record."""

    def __init__(self, outcome):
        super().__init__(f"the candidate's process ended: {outcome}")
        self.outcome = outcome


class CandidateProcess:
    """The job process's side of the candidate's child in a step it drives: the child started under the job's time
    limit (`limit` seconds, counted from its start), with the job's arguments on its standard input and a pipe
    pair for requests; `request` sends one and returns the child's answer. Used as a context manager: leaving it
    ends the child with its process group."""

    def __init__(self, args, limit):
        self.limit = limit
        self.contained = Contained(args.candidate)
        self.scratch = self.contained.scratch  # where the child writes: its progress, each handed-over output
        self.progress = progress_path(self.scratch / "result")
        self.state = self.containment = None  # the child's last progress and the containment record, once ended
        commands_r, self._commands = os.pipe()
        self._replies, replies_w = os.pipe()
        try:
            self.process = start_child(args, self.contained, {"out": str(self.scratch / "result"),
                                                              "channel": [commands_r, replies_w]},
                                       pass_fds=(commands_r, replies_w))
        except BaseException:
            self.contained.end()
            self.contained.remove()
            raise
        finally:
            os.close(commands_r)
            os.close(replies_w)
        self.deadline = self.process.started + limit
        self.buffer = b""
        self.outcome = None

    @property
    def pid(self):
        return self.process.pid

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def request(self, op, stage, **fields):
        """The child's answer to {"op": op, **fields}; raises CandidateFailed where it answers that the candidate
        failed (or answers malformed: the child is killed, a `crashed` failure at `stage`), ChildEnded where it
        ends or runs past the time limit first."""
        line = (json.dumps(dict(fields, op=op)) + "\n").encode()
        try:
            view = memoryview(line)
            while view:
                view = view[os.write(self._commands, view):]
        except BrokenPipeError:
            self._ended(timed_out=False)
        reply = self._reply(stage)
        if set(reply) == {"ok"} and isinstance(reply["ok"], dict):
            return reply["ok"]
        record = reply.get("failed")
        if not (set(reply) == {"failed"} and isinstance(record, dict) and record.get("kind") in candidates.FAILURES
                and isinstance(record.get("stage"), str) and isinstance(record.get("traceback") or [], list)):
            self.outcome = self.process.finish()
            raise CandidateFailed("crashed", stage, "its process answered the job process with neither a result "
                                  f"nor a failure ({str(reply)[:200]}); killed")
        raise CandidateFailed(record["kind"], record["stage"], str(record.get("message")),
                              [str(line) for line in record.get("traceback") or []][-TRACEBACK_LINES:])

    def _reply(self, stage):
        while b"\n" not in self.buffer:
            if len(self.buffer) > REPLY_LIMIT_BYTES:
                self.outcome = self.process.finish()
                raise CandidateFailed("crashed", stage, f"its process answered the job process with more than "
                                      f"{REPLY_LIMIT_BYTES} bytes on one line; killed")
            left = self.deadline - time.monotonic()
            if left <= 0 or not select.select([self._replies], [], [], left)[0]:
                self._ended(timed_out=True)
            chunk = os.read(self._replies, 1 << 16)
            if not chunk:
                self._ended(timed_out=False)
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        try:
            reply = json.loads(line)
        except ValueError:
            reply = {"malformed": line[:200].decode(errors="replace")}
        return reply if isinstance(reply, dict) else {"malformed": reply}

    def _ended(self, timed_out):
        if timed_out:
            log(f"the candidate's process ran past the time limit of {self.limit} s: killing its process group")
        elif not self.process.wait(self.deadline - time.monotonic()):  # it closed its end but runs on
            timed_out = True
        self.outcome = self.process.finish(timed_out)
        raise ChildEnded(self.outcome)

    def close(self):
        """End the child: its requests end (it returns), then its group and every other descendant are killed;
        its last progress is read and its scratch directory removed. Returns what became of it."""
        if self.outcome is None:
            os.close(self._commands)
            self._commands = None
            self.process.wait(min(10.0, max(0.0, self.deadline - time.monotonic())))
            self.outcome = self.process.finish()
        for fd in (self._commands, self._replies):
            if fd is not None:
                os.close(fd)
        self._commands = self._replies = None
        if self.containment is None:
            self.containment = self.contained.end()
            self.state = read_progress(self.progress)
            self.contained.remove()
        return self.outcome


def start_child(args, contained, fields, pass_fds=()):
    """The candidate's child (`python -m shapewise.jobs.candidate`) started as an isolated process under
    `contained`, with the job's arguments, `fields` over them, on its standard input."""
    confinement = contained.child_fields()
    payload = dict(vars(args), job_start=cpus.job_start(), gpu_slot=gpuslots.hand_over(),
                   job_process=jobprocess.process_record(), **fields, **confinement)
    process = candidates.Isolated([sys.executable, "-m", "shapewise.jobs.candidate"], json.dumps(payload),
                                  env=contained.environ, pass_fds=(*pass_fds, confinement["log_fd"]))
    contained.started()
    return process


def check_digest(args):
    found = candidates.digest(args.candidate_path)
    if found != args.impl_digest:
        raise SystemExit(f"candidate {args.candidate}: {args.candidate_path} has SHA-256 {found}, not "
                         f"{args.impl_digest} as when the DAG was built: it changed since; run snakemake again")


def ended_failure(args, outcome, limit, state):
    """The failure record of a child that hung or died, from its last progress `state`; a child that died outside
    the candidate's code is the harness's own error (SystemExit)."""
    if not outcome["timed_out"] and not state["candidate_code"]:
        raise SystemExit(f"candidate {args.candidate}: the job's child process failed at stage {state['stage']} "
                         f"(outside the candidate's code): exit {outcome['returncode']}; see the log above")
    if outcome["timed_out"]:
        record = failure("timeout", state["stage"], f"still running after the time limit of {limit} s; killed")
    else:
        how = (f"killed by {outcome['signal']}" if outcome["signal"] else f"exited with code {outcome['returncode']}"
               " without a result")
        if outcome["signal"] == "SIGKILL":
            how += " (the kernel's out-of-memory killer ends a process so)"
        record = failure("crashed", state["stage"], how)
    log(f"{args.candidate}: FAILED {record['kind']} at {record['stage']}: {record['message']}")
    return record


def drive(args, work):
    """The job process of a candidate step it drives (accuracy, timing): `work(args, device, row, result,
    start)` fills in the result, with start() the CandidateProcess; the result is written here, with the
    candidate's failure where it failed, hung or died."""
    check_digest(args)
    limit = json.loads(args.time_limit)[args.device]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    device = setup(args.device, args.threads)
    row = json.loads(args.row)
    result = header(args.step, row, args.device, args)
    result["candidate"] = describe(args)
    result.update(status=None, failure=None)
    started = []

    def start():
        started.append(CandidateProcess(args, limit))
        return started[-1]

    try:
        work(args, device, row, result, start)
    except CandidateFailed as failed:
        log(f"{args.candidate}: FAILED {failed}")
        result.update(status="fail", failure=failed.record())
    except ChildEnded as ended:
        result.update(status="fail", failure=ended_failure(args, ended.outcome, limit, started[-1].state),
                      isolation=ended.outcome)
    if started:
        result["containment"] = started[-1].containment
    write_result(args.out, result)
    return 0


def supervise(args, outputs_on_failure=None, extra=()):
    """The job process of a candidate step whose child writes the result (profile): the child under the time
    limit, writing the result and the files of the `extra` arguments into its scratch directory, from where they
    are put in place; the failure of a child that hung or died."""
    check_digest(args)
    limit = json.loads(args.time_limit)[args.device]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    contained = Contained(args.candidate)
    try:
        written = {field: contained.scratch / f"{field}-{Path(getattr(args, field)).name}"
                   for field in ("out", *extra)}
        process = start_child(args, contained, {field: str(path) for field, path in written.items()})
        timed_out = not process.wait(limit)
        if timed_out:
            log(f"the candidate's process ran past the time limit of {limit} s: killing its process group")
        outcome = process.finish(timed_out)
        containment = contained.end()
        state = read_progress(progress_path(written["out"]))
        if outcome["returncode"] == 0 and not timed_out and all(path.is_file() for path in written.values()):
            result = json.loads(written["out"].read_text())
            for field, path in written.items():
                if field != "out":
                    copy_regular(path, getattr(args, field))
            result["containment"] = containment
            write_result(args.out, result)
            return 0
    finally:
        contained.end()
        contained.remove()
    record = ended_failure(args, outcome, limit, state)
    if state["header"] is None:  # the child died before its first stage: this process reads the machine instead
        result = header(args.step, json.loads(args.row), args.device, args)
        result["candidate"] = describe(args)
    else:
        result = state["header"]
    result.update(status="fail", failure=record, isolation=outcome, containment=containment)
    if outputs_on_failure is not None:
        outputs_on_failure(args, f"the candidate failed: {record['kind']} at {record['stage']}")
    write_result(args.out, result)
    return 0


def copy_regular(source, target):
    """Copy the regular file `source` (a link there is refused: the child made it) to `target`, atomically."""
    fd = os.open(source, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as src:
        if not stat.S_ISREG(os.fstat(src.fileno()).st_mode):
            raise SystemExit(f"the candidate's process left {source} as no regular file")
        target = Path(target)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(target.name + ".partial")
        with open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        os.replace(tmp, target)
