"""A candidate package: the class lives in a module of the package, imported relatively."""

from .model import UserOptimizedTransformer

__all__ = ["UserOptimizedTransformer"]
