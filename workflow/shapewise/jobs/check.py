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


@torch.inference_mode()
def check(reference, optimized_out, x, mask, reference_fits, settings):
    """Compare; returns (comparisons per preset, description of the check)."""
    if reference_fits:
        ref_out = full_reference(reference, x, mask)
        comparisons = compare_all_presets(ref_out, optimized_out)
        del ref_out
        return comparisons, {
            "method": "full",
            "reference": "BaselineTransformer in float32, TF32 off, on the whole input",
            "batch_indices": "all",
            "query_ranges": [[0, x.shape[1]]],
            "elements_compared": optimized_out.numel(),
            "elements_total": optimized_out.numel(),
        }
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
    opt_sub = optimized_out.index_select(0, index)
    positions = torch.cat([torch.arange(a, b, device=x.device) for a, b in ranges])
    ref_sel = ref_out.index_select(1, positions)
    opt_sel = opt_sub.index_select(1, positions)
    comparisons = compare_all_presets(ref_sel, opt_sel)
    return comparisons, {
        "method": "chunked",
        "reference": ("shapewise.model.chunked.chunked_reference_forward in float32 (TF32 off), "
                      f"query_block {settings['query_block']}, on the sampled batch elements"),
        "batch_indices": batch,
        "query_ranges": [list(r) for r in ranges],
        "elements_compared": opt_sel.numel(),
        "elements_total": optimized_out.numel(),
    }
