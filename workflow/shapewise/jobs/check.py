"""Comparing an optimized output with the reference, full or chunked.

Full check: the reference model in float32 (TF32 off) on the whole input.
Chunked check (the plain reference does not fit): the reference's math via
shapewise.model.chunked.chunked_reference_forward on sampled batch elements; the
comparison covers sampled query blocks (or every position). What was
compared is returned so the report can state it exactly.
"""

from __future__ import annotations

import torch

from shapewise.jobs.models import set_precision
from shapewise.model import TOLERANCES, compare_outputs
from shapewise.model.chunked import chunked_reference_forward


def spread(count, total):
    """`count` indices from range(total): first, last, evenly between."""
    count = min(count, total)
    if count <= 1:
        return [0]
    return sorted({round(i * (total - 1) / (count - 1)) for i in range(count)})


def query_ranges(seq_len, block, samples):
    blocks = [(start, min(seq_len, start + block)) for start in range(0, seq_len, block)]
    if samples == "all":
        return [(0, seq_len)]
    return [blocks[i] for i in spread(int(samples), len(blocks))]


def compare_all_presets(reference_out, optimized_out):
    return {name: compare_outputs(reference_out, optimized_out, rtol=tol["rtol"], atol=tol["atol"]).as_dict()
            for name, tol in TOLERANCES.items()}


@torch.inference_mode()
def full_reference(reference, x, mask):
    set_precision(reference=True)
    try:
        return reference(x.float(), mask)
    finally:
        set_precision(reference=False)


def check(reference, optimized_out, x, mask, reference_fits, settings):
    """Compare; returns (comparisons per preset, description of the check)."""
    return Expected(reference, x, mask, reference_fits, settings).compare(optimized_out)


class Expected:
    """The reference's output for one input, computed once (full, or chunked on sampled batch elements and query
    blocks: `check`'s two methods), against which any number of optimized outputs of that input are compared."""

    @torch.inference_mode()
    def __init__(self, reference, x, mask, reference_fits, settings):
        if reference_fits:
            self.out, self.index, self.positions = full_reference(reference, x, mask), None, None
            self.checked = {
                "method": "full",
                "reference": "BaselineTransformer in float32, TF32 off, on the whole input",
                "batch_indices": "all",
                "query_ranges": [[0, x.shape[1]]],
            }
            return
        self.out, self.index, self.positions, self.checked = _chunked(reference, x, mask, settings)

    @torch.inference_mode()
    def compare(self, optimized_out):
        """(comparisons per preset, description of the check) of one optimized output of the input."""
        got = optimized_out
        if self.index is not None:
            got = got.index_select(0, self.index).index_select(1, self.positions)
        return compare_all_presets(self.out, got), {**self.checked, "elements_compared": got.numel(),
                                                    "elements_total": optimized_out.numel()}


def _chunked(reference, x, mask, settings):
    """The chunked reference's compared elements: (output, batch index, query positions, description)."""
    B, S, _ = x.shape
    batch = spread(settings["batch_samples"], B)
    ranges = query_ranges(S, settings["query_block"], settings["query_samples"])
    index = torch.tensor(batch, device=x.device)
    sub_x = x.index_select(0, index).float()
    sub_mask = None if mask is None else mask.index_select(0, index)
    set_precision(reference=True)
    try:
        ref_out = chunked_reference_forward(reference, sub_x, sub_mask, query_block=settings["query_block"],
                                            compute_dtype=torch.float32)
    finally:
        set_precision(reference=False)
    positions = torch.cat([torch.arange(a, b, device=x.device) for a, b in ranges])
    return ref_out.index_select(1, positions), index, positions, {
        "method": "chunked",
        "reference": ("shapewise.model.chunked.chunked_reference_forward in float32 (TF32 off), "
                      f"query_block {settings['query_block']}, on the sampled batch elements"),
        "batch_indices": batch,
        "query_ranges": [list(r) for r in ranges],
    }
