"""shapewise: a pre-LayerNorm Transformer made fast per shape, and the evidence pipeline that measures it.

One import package with three parts (setup.py maps the folders):
- `shapewise.model`   -> `model/`   at the repository root (the reference and the optimized model)
- `shapewise.kernels` -> `kernels/` at the repository root (our Triton kernels)
- everything else     -> `workflow/shapewise/`, the pipeline, in subpackages each importing only those below it
  (docs/decisions.md, pipeline-subpackages): `cli`; `report`, `tune`, `jobs`; `execution`, `candidates`;
  `provenance`; `inputs`, `analysis`

It is imported as installed (`python3 -m pip install -e .` in a checkout, or a wheel), never from a path.
"""
