"""The pipeline's jobs, one module per step (`python -m shapewise job STEP`, shapewise.cli)."""
