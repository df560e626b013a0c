"""What a result was measured with and from: the implementation, software and machine and their digests
(inventory), the identity a result carries (identity) and a report's provenance.json (provenance).

Imports only shapewise.inputs of the pipeline (pyproject.toml's import contracts)."""
