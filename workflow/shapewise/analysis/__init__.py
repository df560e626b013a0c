"""What a timing means, for the jobs that measure and the report that reads them: bootstrap intervals over the
rounds of a timing (stats) and the roofline floor of a row (roofline).

Imports nothing of the pipeline's other subpackages, only the model (pyproject.toml's import contracts)."""
