"""shapewise: the evidence pipeline around the model (manifests, jobs, report, provenance)."""
