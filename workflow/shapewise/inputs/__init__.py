"""What a run is given and where it lies: the steps (steps), the limits of every file read from a user (limits),
the paths (paths), the configuration (settings) and the shape manifests (manifest).

Imports nothing of the pipeline's other subpackages (pyproject.toml's import contracts): Snakemake reads it while it
builds the DAG, and every other part of the pipeline may import it."""
