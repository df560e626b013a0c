"""The report of a run and the comparison of two: the report job (report), its data (report_data), the candidates'
part (report_candidates), its figures (report_figures) and `shapewise compare` (compare).

Reads the jobs' results as files and imports none of the job modules (pyproject.toml's import contracts)."""
