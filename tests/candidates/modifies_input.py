"""A candidate that normalizes its input in place."""

from shapewise.model import BaselineTransformer


class UserOptimizedTransformer(BaselineTransformer):
    def forward(self, x, valid_token_mask=None):
        x.mul_(1.0)
        return super().forward(x, valid_token_mask)
