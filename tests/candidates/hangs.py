"""A candidate whose forward never returns."""

import time

from shapewise.model import BaselineTransformer


class UserOptimizedTransformer(BaselineTransformer):
    def forward(self, x, valid_token_mask=None):
        while True:
            time.sleep(1)
