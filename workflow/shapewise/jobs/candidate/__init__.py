"""A candidate's jobs (config `candidates`; shapewise.candidates owns the names, paths, digests and isolation).

Each step (accuracy, timing, profile) runs as two processes:
- the job process (`shapewise job candidate-<step>`, which holds the GPU slot and the CPU pinning) checks that
  the candidate's files still have the digest the DAG was built with, then runs `supervise`: the step's `work`
  in a child process (`python -m shapewise.jobs.candidate`) under the job's time limit. It never imports the
  candidate and never touches the GPU while the child lives;
- the child builds the reference and the candidate, runs the step, and writes the result. Whatever the candidate
  does wrong in it (import, constructor, weights, forward) is caught there and recorded as the row's failure
  (`CandidateFailed`); the candidate's output is checked for shape, dtype, device, memory shared with its
  previous output and writes into its input.

When the child hangs past the time limit or dies (a signal, an exit of the candidate's own), the job process
writes the failure from the child's progress file: the result header the child wrote first and the stage it had
reached. Either way the job ends with a result and exit code 0, so the rest of the DAG and the report go on; only
a failure of the harness itself (outside the candidate's code) fails the job.

A candidate is built like shapewise's model: the reference BaselineTransformer(config) after
torch.manual_seed(0) (jobs.models.seeded_reference), the candidate constructed with that config
(shapewise.model.TransformerConfig, the seven contract fields), the reference's state_dict loaded strictly, else
non-strictly with the missing and unexpected keys recorded, then moved to the row's dtype and device.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

import torch

from shapewise import candidates
from shapewise.jobs.io import header, log, write_result
from shapewise.jobs.models import DTYPES, place_reference, seeded_reference

TRACEBACK_LINES = 12  # the last lines of a candidate's traceback kept in its failure record


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
    """fn(*args), the harness's own code run beside the candidate (the reference): a failed allocation there is the
    candidate's out-of-memory failure (the memory the candidate holds counts against the reference's); anything
    else it raises is the harness's own error."""
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
    """The child's progress file: its result header (written before the candidate is imported) and the stage it is
    in, rewritten at every stage; removed once the result is written."""

    def __init__(self, path):
        self.path = Path(path)
        self.state = self.initial()
        self.result = None  # the result being filled in, once begun

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
        self.state.update(stage=name, candidate_code=candidate_code)
        log(f"stage: {name}")
        self._write()

    def _write(self):
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.state, default=str))
        os.replace(tmp, self.path)

    def done(self):
        self.path.unlink(missing_ok=True)


def begin(step, row, args, progress):
    """The result's header with the candidate's record, handed to `progress` first."""
    result = header(step, row, args.device, args)
    result["candidate"] = describe(args)
    progress.begin(result)
    return result


def describe(args):
    """{"name", "path", "layout", "sha256", "files"} of the job's candidate (its digest is the job's
    --impl-digest, checked by `supervise`)."""
    full = candidates.location(args.candidate_path)
    return {"name": args.candidate, "path": args.candidate_path, "layout": "package" if full.is_dir() else "file",
            "sha256": args.impl_digest, "files": candidates.files(args.candidate_path)}


# ------------------------------------------------------------------ the models (in the child)


def build(args, row, config, device, progress, reference_dtype):
    """(reference or None, candidate, weights record). The reference is kept in `reference_dtype` (None: not
    kept); the candidate runs in the row's dtype."""
    progress.stage("import")
    cls = guarded("import", candidates.load_class, args.candidate_path, args.candidate)
    progress.stage("reference weights", candidate_code=False)
    reference = seeded_reference(config)
    progress.stage("construct")
    model = guarded("construct", cls, config)
    progress.stage("weights")
    weights = guarded("weights", load_weights, model, reference.state_dict())
    model = guarded("weights", lambda: model.to(device=device, dtype=DTYPES[row["dtype"]]).eval())
    progress.stage("reference", candidate_code=False)
    if reference_dtype is not None:
        reference = beside("reference", place_reference, reference, row, device, reference_dtype)
    else:
        reference = None
    return reference, model, weights


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
    """Raise CandidateFailed unless `out` is a tensor of x's shape, dtype and device, x was not written
    (its version counter, which counts PyTorch's in-place writes), and `out` shares no memory with `previous`
    (the candidate's previous output, which the caller still holds)."""
    if not isinstance(out, torch.Tensor):
        raise CandidateFailed("wrong-output", stage, f"returned a {type(out).__name__}, expected a tensor")
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


def reference_fit(config, device, headroom):
    """Whether the plain reference fits, as the preflight job decides it: its estimated peak (float32) against the
    free device memory (a GPU) or available RAM (a CPU) times the headroom, read before anything is allocated."""
    from shapewise.jobs import preflight
    from shapewise.jobs.device import free_memory_bytes

    budget = preflight.budget_bytes(free_memory_bytes(device)[0], headroom)
    estimate, fits = preflight.reference_fit(config, budget)
    return {"fits": fits, "estimate_bytes": estimate, "budget_bytes": budget, "headroom": headroom,
            "reason": None if fits else f"resource skip: estimated {estimate} bytes > budget {budget} bytes"}


def run_step(work, args, outputs_on_failure=None):
    """The child's body: `work(args, progress)` writes the result; a CandidateFailed it lets through is written as
    the row's failure into the result it began (with outputs_on_failure(args, note) writing the step's other
    outputs)."""
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


def supervise(args, outputs_on_failure=None):
    """The job process of a candidate step: the child under the time limit, and the failure of a child that hung
    or died."""
    found = candidates.digest(args.candidate_path)
    if found != args.impl_digest:
        raise SystemExit(f"candidate {args.candidate}: {args.candidate_path} has SHA-256 {found}, not "
                         f"{args.impl_digest} as when the DAG was built: it changed since; run snakemake again")
    limit = json.loads(args.time_limit)[args.device]
    progress = Path(progress_path(args.out))
    progress.unlink(missing_ok=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    from shapewise import cpus, gpuslots, jobserver

    payload = dict(vars(args), job_start=cpus.job_start(), gpu_slot=gpuslots.hand_over(),
                   job_process=jobserver.process_record())
    outcome = candidates.run_isolated([sys.executable, "-m", "shapewise.jobs.candidate"], limit,
                                      stdin_text=json.dumps(payload), log=log)
    if outcome["returncode"] == 0 and not outcome["timed_out"] and Path(args.out).is_file():
        return 0
    state = json.loads(progress.read_text()) if progress.is_file() else Progress.initial()
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
    if state["header"] is None:  # the child died before its first stage: this process reads the machine instead
        result = header(args.step, json.loads(args.row), args.device, args)
        result["candidate"] = describe(args)
    else:
        result = state["header"]
    result.update(status="fail", failure=record, isolation=outcome)
    if outputs_on_failure is not None:
        outputs_on_failure(args, f"the candidate failed: {record['kind']} at {record['stage']}")
    write_result(args.out, result)
    progress.unlink(missing_ok=True)
    return 0
