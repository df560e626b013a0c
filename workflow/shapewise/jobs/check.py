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


@torch.inference_mode()
def all_finite(t, block_elements=1 << 26):
    """Whether every element of `t` is finite, read in blocks along its first dimension of about
    `block_elements` each: no boolean copy of the whole tensor (official row 14's output: 3.3 GB) beside a job
    capped at its estimate."""
    if t.dim() == 0 or t.numel() == 0:
        return bool(torch.isfinite(t).all())
    rows = max(1, block_elements // max(1, t[0].numel()))
    return all(bool(torch.isfinite(t[start:start + rows]).all()) for start in range(0, t.shape[0], rows))


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
    return Sampled(optimized_out, x, mask, reference_fits, settings).check(reference)


class Sampled:
    """One optimized output and its input, kept as far as the check reads them: whole for a full check; for a
    chunked one only the sampled batch elements of x (and of the mask) and the output at the sampled elements and
    query positions. A job that drops its own references to the whole input and output before `check` runs the
    chunked reference beside the samples alone (official row 14: 26 GB fewer at the job's peak)."""

    @torch.inference_mode()
    def __init__(self, optimized_out, x, mask, reference_fits, settings):
        self.total, self.settings, self.positions = optimized_out.numel(), settings, None
        if reference_fits:
            self.out, self.x, self.mask = optimized_out, x, mask
            return
        index, self.positions, self.described = _samples(x.shape, settings, x.device)
        self.out = optimized_out.index_select(0, index).index_select(1, self.positions)
        self.x, self.mask = _sampled_input(x, mask, index)

    def check(self, reference):
        """(comparisons per preset, description of the check) against the reference on the kept input."""
        if self.positions is None:
            return Expected(reference, self.x, self.mask, True, None).compare(self.out)
        with torch.inference_mode():
            ref_out = _chunked_reference(reference, self.x, self.mask, self.settings, self.positions)
            return compare_all_presets(ref_out, self.out), {**self.described, "elements_compared": self.out.numel(),
                                                            "elements_total": self.total}


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
        self.index, self.positions, self.checked = _samples(x.shape, settings, x.device)
        self.out = _chunked_reference(reference, *_sampled_input(x, mask, self.index), settings, self.positions)

    @torch.inference_mode()
    def compare(self, optimized_out):
        """(comparisons per preset, description of the check) of one optimized output of the input."""
        got = optimized_out
        if self.index is not None:
            got = got.index_select(0, self.index).index_select(1, self.positions)
        return compare_all_presets(self.out, got), {**self.checked, "elements_compared": got.numel(),
                                                    "elements_total": optimized_out.numel()}


def _samples(shape, settings, device):
    """(batch index, query positions, description) of the chunked check of an input of `shape` [B, S, d]."""
    B, S, _ = shape
    batch = spread(settings["batch_samples"], B)
    ranges = query_ranges(S, settings["query_block"], settings["query_samples"])
    positions = torch.cat([torch.arange(a, b, device=device) for a, b in ranges])
    return torch.tensor(batch, device=device), positions, {
        "method": "chunked",
        "reference": ("shapewise.model.chunked.chunked_reference_forward in float32 (TF32 off), "
                      f"query_block {settings['query_block']}, on the sampled batch elements"),
        "batch_indices": batch,
        "query_ranges": [list(r) for r in ranges],
    }


def _sampled_input(x, mask, index):
    """The batch elements `index` of x and of the mask (None stays None)."""
    return x.index_select(0, index), None if mask is None else mask.index_select(0, index)


def _chunked_reference(reference, sub_x, sub_mask, settings, positions):
    """The chunked reference's output (float32) on the sampled batch elements `sub_x`, at the query `positions`."""
    set_precision(reference=True)
    try:
        out = chunked_reference_forward(reference, sub_x.float(), sub_mask, query_block=settings["query_block"],
                                        compute_dtype=torch.float32)
    finally:
        set_precision(reference=False)
    return out.index_select(1, positions)
