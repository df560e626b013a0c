"""Measuring scripts of shapewise, each run from the repository root as `python -m benchmarks.<name>`: they measure
the installed `shapewise` (`python3 -m pip install -e .` of this checkout)."""
