"""shapewise.model: the reference Transformer, its inputs and comparator, and the drop-in optimized model.

Names are imported on first use: `shapewise.model.config` (and so the pipeline at DAG-build time) needs no
torch, and the optimized model imports the kernels (and so triton) only when asked for.
"""
import importlib

_OWNERS = {
    "TransformerConfig": "config",
    "CONFIG_FIELDS": "config",
    "parameter_count": "config",
    "BaselineTransformer": "reference",
    "check_inputs": "reference",
    "check_parameters_match": "reference",
    "TOLERANCES": "tolerance",
    "Comparison": "tolerance",
    "compare_outputs": "tolerance",
    "describe_comparison": "tolerance",
    "generate_random_case": "cases",
    "padding_lengths": "cases",
    "chunked_reference_forward": "chunked",
    "estimate_memory_bytes": "memory",
    "MemoryBudgetError": "memory",
    "UserOptimizedTransformer": "optimized",
}
__all__ = sorted(_OWNERS)


def __getattr__(name):
    if name in _OWNERS:
        return getattr(importlib.import_module(f".{_OWNERS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
