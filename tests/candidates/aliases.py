"""A candidate that writes every output into one buffer of its own and returns that buffer (as a replayed CUDA
graph's static output would be returned): the caller's previous output changes under it."""

import torch

from shapewise.model import BaselineTransformer


class UserOptimizedTransformer(BaselineTransformer):
    def forward(self, x, valid_token_mask=None):
        out = super().forward(x, valid_token_mask)
        if getattr(self, "buffer", None) is None or self.buffer.shape != out.shape:
            self.buffer = torch.empty_like(out)
        return self.buffer.copy_(out)
