"""A candidate file that defines no UserOptimizedTransformer."""


class OptimizedTransformer:
    pass
