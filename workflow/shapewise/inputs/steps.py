"""The pipeline's steps: the one owner of what each `shapewise job STEP` is.

Per step: what it runs once for (the run, each row, each candidate and row), how its jobs use a GPU, where it
starts among ready jobs, the module whose `main(args)` runs it, and its options in command-line order. From this
registry come the result paths' steps (shapewise.inputs.paths), the GPU lock modes (shapewise.execution.gpuslots) and
the rules' `gpu` resources, the job server's imports (shapewise.execution.jobserver), the priorities and shell commands
of the rules (workflow/rules/common.smk) and the `shapewise job` sub-commands (shapewise.cli). A rule names its step and
lists its own inputs, outputs and params; the options here say which of them the job gets.

Imports nothing of shapewise: every other module may import it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# What a step runs once for: the whole run, each row of the manifests, each candidate on each row.
RUN, SHAPE, CANDIDATE = "run", "shape", "candidate"
# How a job uses its GPU. A job that times (or picks a kernel by timing it) holds its GPU alone for its whole run
# (a step that `prepares`, with config gpu_prepare_shared: from when its models are built and first called, or
# from a kernel choice to time before that); jobs that time nothing may share one GPU with each other, never with an
# exclusive holder (shapewise.execution.gpuslots).
EXCLUSIVE, SHARED = "exclusive", "shared"


@dataclass(frozen=True)
class Option:
    """An option `--NAME VALUE` of `shapewise job`: the value a rule passes (a pattern of Snakemake's shell
    formatting: {params.x}, {input.x}, {output.x}, {wildcards.x}, {threads}, or a global of the workflow) and the
    type the job parses it as."""

    value: str
    type: type = str


# Every step-specific option, by name. A rule whose step takes one provides what its value names.
OPTIONS = {
    "kind": Option("{wildcards.kind}"),
    "dag-digest": Option("{params.digest}"),
    "root": Option("{BASEDIR:q}"),
    "settings": Option("{params.settings:q}"),
    "row": Option("{params.row:q}"),
    "candidate": Option("{wildcards.candidate}"),
    "candidate-path": Option("{params.path:q}"),
    "time-limit": Option("{params.time_limit:q}"),
    "preflight": Option("{input.preflight}"),
    "microbench": Option("{input.microbench}"),
    "headroom": Option("{params.headroom}", float),
    "protocol": Option("{params.protocol:q}"),
    "chunked": Option("{params.chunked:q}"),
    "capture": Option("{params.capture:q}"),
    "csv": Option("{output.csv}"),
    "trace": Option("{output.trace}"),
}
# Options every step's job takes (shapewise.cli defines them): a step lists "device" or "threads" where its rule
# passes it among its own options.
JOB_WIDE = {"device": Option("{params.device}"), "threads": Option("{threads}", int)}


@dataclass(frozen=True)
class Step:
    """One step. `order`: its tier among ready jobs (higher starts first; None: no priority of its own).
    `identity`: its job records the implementation and environment digests and the passed variables (every step
    but the fingerprints, which make those digests). `reported`: the report reads its results (a row's warm-up
    only compiles). `values`: options whose value differs from OPTIONS/JOB_WIDE for this step. `out`: the output
    its --out names. `profiles`: its job records kernel durations, so it never shares its GPU with a job that takes
    several parts of it (shapewise.execution.gpuslots). `costliest_first`: within the step the costliest rows start
    first, not the cheapest. `prepares`: with config gpu_prepare_shared a job of this exclusive step whose row's
    estimate takes one part of its GPU builds its models and makes their first calls sharing the GPU, then holds it
    alone for what it times (shapewise.execution.gpuslots.Slot.upgrade): the building, up to seconds a job, runs
    beside other jobs."""

    name: str
    per: str
    gpu: str
    order: int | None
    module: str
    options: tuple
    identity: bool = True
    reported: bool = True
    values: dict = field(default_factory=dict)
    out: str = "{output}"
    profiles: bool = False
    costliest_first: bool = False
    prepares: bool = False

    def value(self, option):
        if option in self.values:
            return self.values[option]
        return (OPTIONS.get(option) or JOB_WIDE[option]).value

    def own_options(self):
        """{name: Option} of the options this step's job takes besides the job-wide ones."""
        return {name: OPTIONS[name] for name in self.options if name not in JOB_WIDE}


def _step(name, per, gpu, order, options, **kwargs):
    package = "shapewise.jobs.candidate" if per == CANDIDATE else "shapewise.jobs"
    return Step(name, per, gpu, order, f"{package}.{name.replace('-', '_')}", tuple(options), **kwargs)


# The order in which ready jobs start (`order`, Snakemake priorities; workflow/rules/common.smk adds the row's): every
# job that times nothing before any job that times, and within each step the cheapest rows first, except the warm-ups:
# they compile side by side on the CPU and their costliest rows take the longest, so those start first (the last
# warm-up to end is then not one that started last). On a GPU run the
# jobs that time nothing then run side by side on shared GPUs, the warm-ups compile the kernels before the jobs that
# time would, and the jobs that time follow one another with their kernels compiled; a run stopped at a time limit
# has every row's accuracy and the cheapest rows' timings. A candidate's job starts with shapewise's job of the same
# step, so a candidate that compiles or tunes itself on its first call (torch.compile) does it in its accuracy job,
# and not while its timing job holds the GPU alone.
_CANDIDATE_OPTIONS = ("row", "candidate", "candidate-path", "time-limit", "threads")
STEPS = {step.name: step for step in (
    _step("fingerprint", RUN, SHARED, None, ("kind", "device", "dag-digest", "root"), identity=False,
          values={"device": "{DEVICE_ARG}"}),
    _step("microbench", RUN, EXCLUSIVE, None, ("settings", "threads")),
    _step("preflight", SHAPE, SHARED, 4, ("row", "headroom", "chunked")),
    _step("warmup", SHAPE, SHARED, 3, ("row", "preflight", "protocol", "threads"), reported=False,
          costliest_first=True),
    _step("accuracy", SHAPE, SHARED, 2, ("row", "preflight", "chunked", "threads")),
    _step("timing", SHAPE, EXCLUSIVE, 1, ("row", "preflight", "microbench", "protocol", "threads"), prepares=True),
    _step("profile", SHAPE, SHARED, 2, ("row", "preflight", "capture", "threads", "csv", "trace"),
          out="{output.table}", profiles=True),
    _step("ablation", SHAPE, EXCLUSIVE, 1, ("row", "preflight", "protocol", "chunked", "threads"), prepares=True),
    _step("candidate-accuracy", CANDIDATE, SHARED, 2, (*_CANDIDATE_OPTIONS, "headroom", "chunked")),
    _step("candidate-timing", CANDIDATE, EXCLUSIVE, 1, (*_CANDIDATE_OPTIONS, "headroom", "protocol")),
    _step("candidate-profile", CANDIDATE, SHARED, 2, (*_CANDIDATE_OPTIONS, "capture", "csv", "trace"),
          out="{output.table}", profiles=True),
)}


def of(per, reported=None):
    """The names of the steps run once per `per`, in registry order (`reported`: only those the report reads, or
    only those it does not)."""
    return tuple(name for name, step in STEPS.items()
                 if step.per == per and (reported is None or step.reported == reported))


def result_name(step):
    """The name of a candidate's step among its results (candidate-timing -> timing), or the step's own."""
    return step.removeprefix("candidate-") if STEPS[step].per == CANDIDATE else step


def shell(name, job="{JOB}"):
    """The shell command (a pattern of Snakemake's shell formatting) of a job of step `name`: `job` (the command
    that runs `shapewise job`), the step and its options; for a job that records its identity, the device first
    and the implementation's digest (a candidate's job: the candidate's), the environment's and the passed
    variables (`params.pass_env`) last; then its result file and its log."""
    step = STEPS[name]
    options = " ".join(f"--{option} {step.value(option)}" for option in step.options)
    if step.identity:
        impl = "{params.digest}" if step.per == CANDIDATE else "{IMPL_DIGEST}"
        options = (f"--device {step.value('device')} {options} --impl-digest {impl} --env-digest {{ENV_DIGEST}} "
                   "{params.pass_env}")
    return f"{job} {name} {options} --out {step.out} > {{log}} 2>&1"
