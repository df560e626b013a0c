"""What a pipeline run needs from the checkout, and a copy of it for tests that run Snakemake in a temporary
directory: the one list (tests/test_config.py, test_pipeline.py, test_report.py and test_slurm.py use it)."""

from __future__ import annotations

import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# model/ and kernels/ travel too: the implementation fingerprint hashes the working directory's copies (the jobs
# run the installed package, this checkout's).
PIPELINE_FILES = ("Snakefile", "pyproject.toml", "setup.py", "workflow", "model", "kernels", "config", "shapes",
                  "profiles")
IGNORED = shutil.ignore_patterns("__pycache__", "*.pyc", ".snakemake", "results")


def copy_checkout(dest: Path) -> Path:
    """Copy PIPELINE_FILES of this checkout into `dest` (file times kept) and return `dest`."""
    dest = Path(dest)
    for name in PIPELINE_FILES:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=IGNORED)
        else:
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest
