"""shapewise: a pre-LayerNorm Transformer made fast per shape, and the evidence pipeline that measures it.

One import package with three parts:
- `shapewise.model`   -> `model/`   at the repository root (the reference and the optimized model)
- `shapewise.kernels` -> `kernels/` at the repository root (our Triton kernels)
- everything else     -> `workflow/shapewise/` (manifests, pipeline jobs, report, provenance, CLI)

An install maps the two root folders through `package-dir` (pyproject.toml). Run from a checkout with
`workflow/` on `sys.path` (what the Snakefile, the pipeline's jobs and the tests do), the lines below let the
same names resolve to this checkout's `model/` and `kernels/`, so a job always runs the code beside its rules.
"""
from pathlib import Path as _Path

_CHECKOUT = _Path(__file__).resolve().parent.parent.parent
if (_CHECKOUT / "model" / "__init__.py").is_file() and (_CHECKOUT / "kernels" / "__init__.py").is_file():
    __path__.append(str(_CHECKOUT))  # noqa: F821 - the package's own search path
