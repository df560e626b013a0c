"""A candidate whose forward kills its own process (as a segmentation fault in an extension would)."""

import os
import signal

from shapewise.model import BaselineTransformer


class UserOptimizedTransformer(BaselineTransformer):
    def forward(self, x, valid_token_mask=None):
        os.kill(os.getpid(), signal.SIGSEGV)
