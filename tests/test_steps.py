"""The step registry (shapewise.inputs.steps) and what is derived from it: paths, GPU modes, the job server's imports,
the `shapewise job` sub-commands and the rules' shell commands."""

import importlib
import re

import pytest

from shapewise import cli
from shapewise.execution import gpuslots
from shapewise.inputs import paths, steps
from checkout import REPO


def test_each_step_runs_its_own_module():
    for name, step in steps.STEPS.items():
        module = importlib.import_module(step.module)
        assert callable(getattr(module, "main", None)), f"{step.module} has no main(args) for step {name}"


def test_the_registry_is_consistent():
    assert set(steps.OPTIONS).isdisjoint(steps.JOB_WIDE)
    for name, step in steps.STEPS.items():
        assert step.per in (steps.RUN, steps.SHAPE, steps.CANDIDATE), name
        assert step.gpu in gpuslots.MODES, name
        assert len(set(step.options)) == len(step.options), f"{name} lists an option twice"
        unknown = [o for o in step.options if o not in steps.OPTIONS and o not in steps.JOB_WIDE]
        assert not unknown, f"{name}: options {unknown} are in neither OPTIONS nor JOB_WIDE"
        assert set(step.values) <= set(step.options), name
        assert (step.order is None) == (step.per == steps.RUN), f"{name}: only the per-run steps have no order"


def test_paths_and_gpu_modes_come_from_the_registry():
    assert paths.SHAPE_STEPS == ("preflight", "accuracy", "timing", "profile", "ablation")
    assert paths.WARMUP_STEP == "warmup"
    assert paths.CANDIDATE_STEPS == ("accuracy", "timing", "profile")
    assert gpuslots.GPU_USE == {name: step.gpu for name, step in steps.STEPS.items()}
    timing = {name for name, mode in gpuslots.GPU_USE.items() if mode == gpuslots.EXCLUSIVE}
    assert timing == {"microbench", "timing", "ablation", "candidate-timing"}  # the jobs that time


def _argv(name, step, drop=None):
    argv = ["job", name, "--device", "cpu", "--out", "out.json"]
    for option in step.own_options():
        if option != drop:
            argv += [f"--{option}", "1"]
    return argv


def test_the_cli_has_one_job_sub_command_per_step_each_option_required(capsys):
    parser = cli.build_parser()
    for name, step in steps.STEPS.items():
        args = parser.parse_args(_argv(name, step) + ["--threads", "2"])
        assert args.step == name and args.threads == 2
        for option, spec in step.own_options().items():
            assert getattr(args, option.replace("-", "_")) == spec.type("1"), (name, option)
        for option in step.own_options():
            with pytest.raises(SystemExit):
                parser.parse_args(_argv(name, step, drop=option))
            assert f"--{option}" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser.parse_args(["job", "no-such-step", "--device", "cpu", "--out", "out.json"])
    assert "no-such-step" in capsys.readouterr().err


# Snakemake reruns the jobs of a rule whose shell command changes: these are the commands the results were made with.
PINNED = {
    "fingerprint": "{JOB} fingerprint --kind {wildcards.kind} --device {DEVICE_ARG} --dag-digest {params.digest} "
                   "--root {BASEDIR:q} --out {output} > {log} 2>&1",
    "timing": "{JOB} timing --device {params.device} --row {params.row:q} --preflight {input.preflight} --microbench "
              "{input.microbench} --protocol {params.protocol:q} --threads {threads} --impl-digest {IMPL_DIGEST} "
              "--env-digest {ENV_DIGEST} {params.pass_env} --out {output} > {log} 2>&1",
    "profile": "{JOB} profile --device {params.device} --row {params.row:q} --preflight {input.preflight} --capture "
               "{params.capture:q} --threads {threads} --csv {output.csv} --trace {output.trace} --impl-digest "
               "{IMPL_DIGEST} --env-digest {ENV_DIGEST} {params.pass_env} --out {output.table} > {log} 2>&1",
    "candidate-accuracy": "{JOB} candidate-accuracy --device {params.device} --row {params.row:q} --candidate "
                          "{wildcards.candidate} --candidate-path {params.path:q} --time-limit {params.time_limit:q} "
                          "--threads {threads} --headroom {params.headroom} --chunked {params.chunked:q} "
                          "--impl-digest {params.digest} --env-digest {ENV_DIGEST} {params.pass_env} --out {output} "
                          "> {log} 2>&1",
}


@pytest.mark.parametrize("name", sorted(PINNED))
def test_shell_commands_are_pinned(name):
    assert steps.shell(name) == PINNED[name]


RULE = re.compile(r"^rule (\w+):\n(.*?)(?=^rule |\Z)", re.M | re.S)


def test_each_rule_of_a_step_provides_what_its_options_name():
    """Each rule whose shell is job_shell(STEP) names the params, inputs and outputs STEP's options take."""
    rules = {}
    for smk in (REPO / "workflow" / "rules").glob("*.smk"):
        for name, body in RULE.findall(smk.read_text()):
            rules[name] = body
    shared = {"ROW_PARAMS": {"row", "harness", "pass_env", "device"}, "ROW_INPUTS": {"env", "impl", "preflight"},
              "CANDIDATE_PARAMS": {"row", "harness", "pass_env", "device", "path", "digest", "time_limit"},
              "CANDIDATE_INPUTS": {"env"}, "FINGERPRINTS": {"env", "impl"}}
    seen = set()
    for rule, body in rules.items():
        called = re.search(r'job_shell\("([\w-]+)"\)', body)
        if called is None:
            continue
        step = called.group(1)
        seen.add(step)
        assert rule == step.replace("-", "_"), f"rule {rule} runs step {step}"
        sections = dict(re.findall(r"^    (\w+):\n((?:        .*\n)+)", body, re.M))
        for kind, key in re.findall(r"\{(params|input|output)\.(\w+)", steps.shell(step)):
            text = sections.get(kind, "")
            names = set(re.findall(r"^        (\w+)=", text, re.M))
            names |= {n for spread, keys in shared.items() if f"**{spread}" in text for n in keys}
            names |= {"csv", "trace"} if "profile_extra(" in text else set()
            assert key in names, f"rule {rule}: step {step}'s command takes {kind}.{key}, not in its {kind}"
    assert seen == set(steps.STEPS), f"steps without a rule: {set(steps.STEPS) - seen}"
