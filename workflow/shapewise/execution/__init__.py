"""How a run's jobs run on a machine: the GPU slots (gpuslots), what a job sharing its GPU must not do (gpushare),
a slot's CPU cores (cpus), one job in its process (jobprocess), the run's job server (jobserver) and the runs
themselves (runs).

Imports only shapewise.provenance and shapewise.inputs of the pipeline (pyproject.toml's import contracts); the job
modules (shapewise.jobs) it runs by name, from shapewise.inputs.steps."""
