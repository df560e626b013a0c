"""A candidate that runs and returns the right shape, 10 % off the reference."""

from shapewise.model import BaselineTransformer


class UserOptimizedTransformer(BaselineTransformer):
    def forward(self, x, valid_token_mask=None):
        return super().forward(x, valid_token_mask) * 1.1
