"""The inputs of one trial of a row: x in the row's dtype and its valid-token mask."""

from __future__ import annotations

import torch

from shapewise.model import generate_random_case, padding_lengths

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
FIRST_TRIAL_SEED = 1234  # trial t draws its inputs with this seed + t
MASK_SEED_OFFSET = 7919  # left/holes masks come from their own generator, seed + this


# Inputs of at least this many elements are drawn on the GPU (official row 14's 3.3e9 normal values would take
# tens of seconds a case on a CPU); smaller ones on the CPU, so a seed gives the same case on every device.
DEVICE_DRAW_MIN_ELEMENTS = 2**30


def input_generator(config, device) -> str:
    """generate_random_case's generator_device for this shape on this device ("cpu" or "device")."""
    big = config.batch_size * config.seq_len * config.d_model >= DEVICE_DRAW_MIN_ELEMENTS
    return "device" if big and torch.device(device).type == "cuda" else "cpu"


def make_case(row, config, device, seed):
    """Inputs of one trial: x in the row's dtype and the valid-token mask.

    prefix masks come from model.generate_random_case. left and holes masks
    use the same length rule (lengths in [max(1, round(S(1-p))), S]) from a
    generator seeded with seed + MASK_SEED_OFFSET: left puts the padding
    first, holes scatters it over random positions. Padded rows of x are
    zeroed in every case. Without padding the row's `pass_mask` decides the call: true (the default, the
    official harness's call) passes an all-True bool mask, false passes none. Returns (x, mask or None,
    mask_kind) with mask_kind in none/all-true/prefix/general.
    """
    dtype = DTYPES[row["dtype"]]
    kind = row["mask"]
    ratio = row["padding_ratio"] if kind == "prefix" else 0.0
    x, mask = generate_random_case(config, device, dtype, seed, padding_ratio=ratio,
                                   input_scale=row["input_scale"], generator_device=input_generator(config, device))
    if kind == "none":
        if row.get("pass_mask", True):  # the official harness's call: an all-True bool mask, always passed
            return x, torch.ones(x.shape[:2], dtype=torch.bool, device=x.device), "all-true"
        return x, None, "none"
    if kind == "prefix":
        return x, mask, kind
    B, S = config.batch_size, config.seq_len
    gen = torch.Generator(device="cpu").manual_seed(int(seed) + MASK_SEED_OFFSET)
    lengths = padding_lengths(S, row["padding_ratio"], B, gen)
    positions = torch.arange(S)
    if kind == "left":
        mask = positions[None, :] >= (S - lengths)[:, None]
    else:  # holes
        mask = torch.zeros(B, S, dtype=torch.bool)
        for b in range(B):
            keep = torch.randperm(S, generator=gen)[: int(lengths[b])]
            mask[b, keep] = True
    mask = mask.to(device)
    x = x.masked_fill(~mask[..., None], 0.0)
    return x, mask, "general"
