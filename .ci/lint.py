"""`snakemake --lint` on the workflow as a CPU machine parses it: exit 0 when every lint it prints is one the
workflow keeps on purpose (ACCEPTED; workflow/rules/common.smk says why, beside JOB), else print the others and
exit 1. Run from anywhere: `python3 .ci/lint.py`."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMMAND = [sys.executable, "-m", "snakemake", "--lint", "--config", "device=cpu", "shapes=smoke"]
ACCEPTED = (
    re.compile(r"Specify a conda environment or container for each rule\."),
    re.compile(r"Shell command directly uses variable (JOB|REPORT|BASEDIR|DEVICE_ARG|IMPL_DIGEST|ENV_DIGEST) "
               r"from outside of the rule"),
)
HEADING = re.compile(r"^Lints for (?P<where>.+):$")
LINT = re.compile(r"^    \* (?P<title>.+?):?$")


def lints(text):
    """[(where, title)] of the lints in `snakemake --lint`'s text output."""
    found, where = [], None
    for line in text.splitlines():
        heading = HEADING.match(line)
        if heading:
            where = heading.group("where")
            continue
        lint = LINT.match(line)
        if lint and where is not None:
            found.append((where, lint.group("title")))
    return found


def main():
    done = subprocess.run(COMMAND, cwd=ROOT, capture_output=True, text=True, timeout=300)
    text = done.stdout + done.stderr
    found = lints(text)
    if done.returncode != 0 and not found:
        print(f"{' '.join(COMMAND[1:])} failed ({done.returncode}) without a lint:\n{text}", file=sys.stderr)
        return 1
    others = [(where, title) for where, title in found if not any(p.fullmatch(title) for p in ACCEPTED)]
    for where, title in others:
        print(f"lint: {where}: {title}", file=sys.stderr)
    kept = len(found) - len(others)
    print(f"snakemake --lint: {len(others)} lint(s) to fix, {kept} accepted (workflow/rules/common.smk says why)")
    return 1 if others else 0


if __name__ == "__main__":
    raise SystemExit(main())
