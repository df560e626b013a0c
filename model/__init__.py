"""shapewise models: the reference Transformer and the drop-in optimized one."""
from .reference import (
    TOLERANCES,
    BaselineTransformer,
    Comparison,
    TransformerConfig,
    compare_outputs,
    generate_random_case,
)

__all__ = [
    "TOLERANCES",
    "BaselineTransformer",
    "Comparison",
    "TransformerConfig",
    "UserOptimizedTransformer",
    "compare_outputs",
    "generate_random_case",
]


def __getattr__(name):  # the optimized model imports the kernels (and so triton) only when asked for
    if name == "UserOptimizedTransformer":
        from .optimized import UserOptimizedTransformer

        return UserOptimizedTransformer
    raise AttributeError(f"module 'model' has no attribute {name!r}")
