"""The model's configuration: the contract's seven fields, their checks, and the sizes that follow from them.

Imports no torch: the pipeline reads it while Snakemake builds its DAG.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

CONFIG_FIELDS = ("batch_size", "seq_len", "d_model", "num_heads", "ffn_dim", "num_layers", "causal")


@dataclass(frozen=True)
class TransformerConfig:
    batch_size: int
    seq_len: int
    d_model: int
    num_heads: int
    ffn_dim: int
    num_layers: int
    causal: bool = True

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    @property
    def tokens(self) -> int:
        return self.batch_size * self.seq_len

    def validate(self) -> "TransformerConfig":
        for name in CONFIG_FIELDS[:-1]:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"TransformerConfig.{name} must be an int, got {type(value).__name__} {value!r}")
            if value <= 0:
                raise ValueError(f"TransformerConfig.{name} must be positive, got {value}")
        if self.d_model % self.num_heads != 0:
            raise ValueError(
                f"TransformerConfig: d_model ({self.d_model}) must be divisible by num_heads ({self.num_heads})"
            )
        if not isinstance(self.causal, bool):
            raise TypeError(f"TransformerConfig.causal must be a bool, got {self.causal!r}")
        return self

    @classmethod
    def from_any(cls, config) -> "TransformerConfig":
        """Copy the seven contract fields from any object that has them (e.g. another harness's config)."""
        if isinstance(config, cls):
            return config.validate()
        missing = [name for name in CONFIG_FIELDS if not hasattr(config, name)]
        if missing:
            raise TypeError(f"config object {type(config).__name__} lacks field(s) {', '.join(missing)}")
        values = {name: getattr(config, name) for name in CONFIG_FIELDS}
        return cls(**values).validate()

    def as_dict(self) -> dict:
        return asdict(self)


def parameter_count(d_model: int, ffn_dim: int, num_layers: int) -> int:
    """Weights and biases of the model: per layer 4 projections (d x d + d), the FFN (d x ffn + ffn, ffn x d + d)
    and 2 LayerNorms (2d each); then the final LayerNorm (2d)."""
    d, f = d_model, ffn_dim
    per_layer = 4 * (d * d + d) + (d * f + f) + (f * d + d) + 2 * (2 * d)
    return num_layers * per_layer + 2 * d
