"""A candidate whose forward asks for more memory than any machine has (a petabyte workspace)."""

import torch

from shapewise.model import BaselineTransformer


class UserOptimizedTransformer(BaselineTransformer):
    def forward(self, x, valid_token_mask=None):
        workspace = torch.empty(2**50, dtype=torch.uint8, device=x.device)
        return super().forward(x, valid_token_mask) + workspace[:1].float()
