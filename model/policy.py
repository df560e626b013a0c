"""The routing policy, `routing_policy.json` beside this file (thresholds and precisions read off the H200's
accuracy and ablation tables), read once: `POLICY` is the one dict `routing.select_route` and the route modules
read. A leaf, as model/route.py: the route modules import it without importing routing.
"""
from __future__ import annotations

import json
from pathlib import Path

POLICY_PATH = Path(__file__).with_name("routing_policy.json")
POLICY = json.loads(POLICY_PATH.read_text())


def attention_without_hopper(seq_len: int) -> str:
    """The triton route's attention where the Hopper attention does not run: PyTorch SDPA from the policy's
    `attention.sdpa_from_seq_len` (null: never), else our kernel."""
    sdpa_from = POLICY["attention"]["sdpa_from_seq_len"]
    return "sdpa" if sdpa_from is not None and seq_len >= sdpa_from else "triton"
