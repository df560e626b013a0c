"""A correct candidate with a parameter the reference does not have (a learned output gain, at its initial 1):
the reference's weights load non-strictly, the gain is recorded as a missing key."""

import torch

from shapewise.model import BaselineTransformer


class UserOptimizedTransformer(BaselineTransformer):
    def __init__(self, config):
        super().__init__(config)
        self.output_gain = torch.nn.Parameter(torch.ones(()))

    def forward(self, x, valid_token_mask=None):
        return super().forward(x, valid_token_mask) * self.output_gain
