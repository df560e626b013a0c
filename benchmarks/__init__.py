"""Measuring scripts of shapewise, each run from the repository root as `python -m benchmarks.<name>`."""
import sys
from pathlib import Path

# The checkout's own package comes first, so a benchmark measures the code beside it whatever else is installed.
_WORKFLOW = str(Path(__file__).resolve().parent.parent / "workflow")
if _WORKFLOW not in sys.path:
    sys.path.insert(0, _WORKFLOW)
