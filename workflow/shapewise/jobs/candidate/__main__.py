"""The child process of a candidate job (shapewise.jobs.candidate.supervise starts it): the job's arguments as
JSON on standard input; runs the step's work and writes its result."""

import argparse
import importlib
import json
import sys

from shapewise.execution import cpus, gpuslots, jobprocess
from shapewise.inputs import steps
from shapewise.jobs.candidate.contain import adopt_log


def main():
    payload = json.loads(sys.stdin.read())
    adopt_log(payload.pop("log_fd"))  # what this process and its descendants print goes through the job's cap
    cpus.adopt_job_start(payload.pop("job_start"))  # the job process pinned this process's cores already
    gpuslots.take_over(payload.pop("gpu_slot", None))  # and holds the GPU's lock for this process's work
    jobprocess.adopt_process_record(payload.pop("job_process", None))
    args = argparse.Namespace(**payload)
    step = importlib.import_module(steps.STEPS[args.step].module)
    return step.child(args)


if __name__ == "__main__":
    raise SystemExit(main())
