"""A candidate whose forward raises."""

from shapewise.model import BaselineTransformer


class UserOptimizedTransformer(BaselineTransformer):
    def forward(self, x, valid_token_mask=None):
        raise RuntimeError("kernel launch failed: invalid configuration argument")
