"""Candidates: other implementations of the contract, measured beside shapewise against the same reference.

config `candidates` names them, NAME -> PATH (in config/config.yaml a mapping, on the command line
`--config candidates=NAME=PATH[,NAME=PATH...]`). PATH is a Python file, or a package directory (with
`__init__.py`), that defines `UserOptimizedTransformer`; the jobs construct it as the official harness does, with
one config argument carrying batch_size, seq_len, d_model, num_heads, ffn_dim, num_layers and causal, load the
reference's weights into it, and call it as `model(x, valid_token_mask)`. shapewise.jobs.candidate runs them.

This module owns:
- the names and paths (`parse`; a bad entry is a CandidateError naming it) and a candidate's files and digest
  (`files`, `digest`: the SHA-256 of every file of it, which decides what reruns), and the reference's own
  source files (`reference_files`), whose digest reruns every candidate's jobs when the baseline changes;
- loading (`load_class`): the file is imported under a module name of its own, never as `__main__`, so a file
  that carries its own copy of the official harness around its class (the reference classes, a `main()`, an
  `if __name__ == "__main__":` block) runs none of it;
- isolation (`Isolated`, `run_isolated`): a candidate's code runs in a child process, in a process group of its
  own, under a time limit; a child that outlives the limit is killed with its whole group. `FAILURES` names every
  way a candidate can fail a row; `classify` turns an exception of the child into one of them.

Imports no torch: Snakemake calls `parse` and `digest` while it builds the DAG.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

import shapewise.model as model_package
from shapewise.inputs import paths
from shapewise.provenance.inventory import digest_of, sha256_file

CLASS_NAME = "UserOptimizedTransformer"
# Names the report and summary.csv give the two models every run measures; no candidate may take them.
SHAPEWISE, REFERENCE = "shapewise", "reference"
RESERVED = (SHAPEWISE, REFERENCE)
# Every way a candidate fails a row (the result's failure.kind), in words.
FAILURES = {
    "import": "failed to import, or defines no UserOptimizedTransformer",
    "raises": "raised an exception",
    "timeout": "did not finish within the job's time limit (config candidate_time_limit_s)",
    "out-of-memory": "ran out of memory",
    "crashed": "the process running it died",
    "wrong-output": "returned something other than a tensor of the input's shape, dtype and device",
    "aliased-output": "returned an output that shares memory with its previous output",
    "modified-input": "wrote into its input x",
    "accuracy": "failed the official tolerance",
}
# Files of a package directory that importing it writes: never part of what the candidate is.
_GENERATED = re.compile(r"(^|/)__pycache__(/|$)|\.py[co]$")
# The names the candidate jobs take from shapewise.model: their modules, and the modules those import, are the
# reference side of every candidate's measurement.
REFERENCE_NAMES = ("BaselineTransformer", "TransformerConfig", "generate_random_case", "padding_lengths",
                   "compare_outputs", "TOLERANCES", "chunked_reference_forward", "estimate_memory_bytes")


class CandidateError(ValueError):
    """A candidate entry that cannot be used; the message names it."""


@functools.cache
def name_pattern() -> str:
    """The row-id pattern (shapes schema), which candidate names follow: a name is a wildcard and a file name."""
    schema = yaml.safe_load(paths.SHAPES_SCHEMA.read_text())
    return schema["items"]["properties"]["id"]["pattern"]


def name_body() -> str:
    """`name_pattern` without its anchors (`^`, and `(?!\\n)$`: the end, not before a final newline), to be
    embedded in a longer pattern (the NAME=PATH string form, Snakemake's wildcard constraint)."""
    pattern = name_pattern()
    end = "(?!\\n)$"
    if not (pattern.startswith("^") and pattern.endswith(end)):
        raise ValueError(f"{paths.SHAPES_SCHEMA}: the id pattern {pattern!r} must start with ^ and end with {end}")
    return pattern[1:-len(end)]


def parse(value, root=".") -> dict:
    """{name: path} of config `candidates`: a mapping, or the command line's "NAME=PATH,NAME=PATH" string; None
    or empty: no candidate. Each path must be a .py file or a directory with __init__.py (relative paths are
    relative to `root`, the checkout); it is returned as given."""
    if value in (None, "", {}):
        return {}
    if isinstance(value, str):
        entries = {}
        for item in value.split(","):
            name, sep, path = item.partition("=")
            if not sep or not name or not path:
                raise CandidateError(f"config candidates: {item!r} is not NAME=PATH "
                                     f"(--config candidates=NAME=PATH[,NAME=PATH...])")
            if name in entries:
                raise CandidateError(f"config candidates: {name!r} is named twice")
            entries[name] = path
    elif isinstance(value, dict):
        entries = dict(value)
    else:
        raise CandidateError(f"config candidates: expected a mapping NAME: PATH or NAME=PATH,..., "
                             f"got {type(value).__name__} {value!r}")
    for name, path in entries.items():
        check(name, path, root)
    return entries


def check(name, path, root="."):
    """Raise CandidateError unless `name` is a usable candidate name and `path` a candidate's file or package."""
    if not isinstance(name, str) or not re.fullmatch(name_pattern(), name):
        raise CandidateError(f"config candidates: name {name!r} does not match {name_pattern()} "
                             f"(a candidate's name is part of its result files' names)")
    if name in RESERVED:
        raise CandidateError(f"config candidates: {name!r} is the name of a model every run measures "
                             f"({', '.join(RESERVED)}); give the candidate another name")
    if not isinstance(path, str) or not path:
        raise CandidateError(f"config candidates: {name}: the path must be a non-empty string, got {path!r}")
    full = location(path, root)
    if full.is_dir():
        if not (full / "__init__.py").is_file():
            raise CandidateError(f"config candidates: {name}={path}: a directory without __init__.py "
                                 f"(a candidate is a .py file or a package directory)")
    elif not full.is_file():
        raise CandidateError(f"config candidates: {name}={path}: no such file or directory")
    elif full.suffix != ".py":
        raise CandidateError(f"config candidates: {name}={path}: not a .py file "
                             f"(a candidate is a .py file or a package directory)")


def location(path, root=".") -> Path:
    """The candidate's file or directory: `path` itself when absolute, else relative to `root`."""
    path = Path(path)
    return path if path.is_absolute() else Path(root) / path


def files(path, root=".") -> dict:
    """{relative path: SHA-256} of every file of the candidate: the file itself (by its name), or every file under
    the package directory (bytecode caches left out: importing the package writes them)."""
    full = location(path, root)
    if full.is_file():
        return {full.name: sha256_file(full)}
    out = {}
    for item in sorted(full.rglob("*")):
        rel = item.relative_to(full).as_posix()
        if item.is_file() and not _GENERATED.search(rel):
            out[rel] = sha256_file(item)
    return out


def digest(path, root=".") -> str:
    """The candidate's SHA-256: of the file's bytes, or over the package's {relative path: SHA-256} (canonical
    JSON), so an edit of any of its files changes it."""
    found = files(path, root)
    if location(path, root).is_file():
        return next(iter(found.values()))
    return digest_of(found)


def reference_files(root=".") -> list[Path]:
    """The source files of the reference side of a candidate's measurement: the modules of model/ that define
    REFERENCE_NAMES (as shapewise.model's table of owners names them) and every module of model/ they import when
    they load. An import inside a function is left out: memory.py imports the routing only to estimate the
    optimized model, which no candidate job asks for."""
    owners = getattr(model_package, "_OWNERS")
    missing = [name for name in REFERENCE_NAMES if name not in owners]
    if missing:
        raise CandidateError(f"shapewise.model does not export {', '.join(missing)}, which the candidate jobs use")
    model_dir = Path(root) / "model"
    todo = [model_dir / "__init__.py"] + [model_dir / f"{owners[name]}.py" for name in REFERENCE_NAMES]
    seen = set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for node in ast.parse(path.read_text(), str(path)).body:  # imports at load time, not those inside functions
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
                todo.append(model_dir / f"{node.module.split('.')[0]}.py")
    return sorted(p for p in seen if p.is_file())


# ------------------------------------------------------------------ loading (in the job's child process)


def load_class(path, name, root="."):
    """The candidate's UserOptimizedTransformer. A file is imported as module `shapewise_candidate_<name>` (its
    directory first on sys.path, as `python file.py` would have it, so its sibling modules import), a package
    directory as package `shapewise_candidate_<name>` (its relative imports work). Neither is `__main__`."""
    full = location(path, root).resolve()
    module_name = f"shapewise_candidate_{name.replace('-', '_')}"
    sys.dont_write_bytecode = True  # leave no __pycache__ in the user's directory
    if full.is_dir():
        spec = importlib.util.spec_from_file_location(module_name, full / "__init__.py",
                                                      submodule_search_locations=[str(full)])
    else:
        sys.path.insert(0, str(full.parent))
        spec = importlib.util.spec_from_file_location(module_name, full)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses and pickling look a module up by its name while it loads
    spec.loader.exec_module(module)
    cls = getattr(module, CLASS_NAME, None)
    if not isinstance(cls, type):
        raise ImportError(f"{full} defines no class {CLASS_NAME}"
                          + ("" if cls is None else f" ({CLASS_NAME} is a {type(cls).__name__})"))
    return cls


def is_out_of_memory(exc) -> bool:
    """An allocation that failed: torch's OutOfMemoryError (a GPU), Python's MemoryError, or the CPU allocator's
    RuntimeError ("can't allocate memory")."""
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text.lower())


def classify(exc, stage) -> str:
    """The failure kind of an exception the candidate raised at `stage` (import, construct, weights, forward)."""
    if is_out_of_memory(exc):
        return "out-of-memory"
    if stage == "import":
        return "import"
    return "raises"


# ------------------------------------------------------------------ isolation


class Isolated:
    """A child process in a new process group, with `stdin_text` on its standard input (then closed) and its
    output going where this process's goes; `pass_fds` stay open in it. While it lives, SIGTERM and SIGINT to this
    process kill its whole group first (the group would otherwise outlive this process); `finish` kills the group
    in any case (also what a child that ended left running: compile workers) and returns what became of it."""

    def __init__(self, argv, stdin_text="", env=None, pass_fds=()):
        self.started = time.monotonic()
        self.child = subprocess.Popen(argv, stdin=subprocess.PIPE, env=env, preexec_fn=os.setpgrp, text=True,
                                      pass_fds=tuple(pass_fds))
        self.previous = {s: signal.signal(s, self._stop) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            self.child.stdin.write(stdin_text)
            self.child.stdin.close()
        except BrokenPipeError:  # the child ended before it read its input: its return code says why
            pass

    def _stop(self, signum, frame):
        _kill_group(self.child)
        raise SystemExit(128 + signum)

    @property
    def pid(self):
        return self.child.pid

    def wait(self, timeout) -> bool:
        """Whether the child ended within `timeout` seconds."""
        try:
            self.child.wait(timeout=max(0.0, timeout))
            return True
        except subprocess.TimeoutExpired:
            return False

    def finish(self, timed_out=False) -> dict:
        """Kill the group; {"returncode", "signal" (the name of the signal that ended the child, or None),
        "timed_out", "seconds"}."""
        _kill_group(self.child)
        for s, handler in self.previous.items():
            signal.signal(s, handler)
        code = self.child.returncode
        return {"returncode": code, "signal": signal.Signals(-code).name if code is not None and code < 0 else None,
                "timed_out": timed_out, "seconds": round(time.monotonic() - self.started, 3)}


def run_isolated(argv, time_limit_s, stdin_text="", env=None, log=print) -> dict:
    """Run `argv` as an Isolated child and wait for it; kill its whole group when it runs past `time_limit_s`
    seconds. Returns Isolated.finish's record."""
    child = Isolated(argv, stdin_text, env)
    timed_out = False
    try:
        if not child.wait(time_limit_s):
            timed_out = True
            log(f"the candidate's process ran past the time limit of {time_limit_s} s: killing its process group")
    finally:
        outcome = child.finish(timed_out)
    return outcome


def _kill_group(child):
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # the group is gone
        pass
    child.wait()
