"""Shared helpers of the tests of the whole model (tests/test_model_*.py): small configs, masks, inputs, a model
pair on the same weights, an fp64 forward written independently of shapewise.model, the official check.

Small configs only (B<=2, S<=33, d<=64, 1-2 layers): the Triton routes run under TRITON_INTERPRET=1 on a CPU.
"""

import math

import torch
import torch.nn.functional as F
from shapewise.model import (
    TOLERANCES,
    BaselineTransformer,
    TransformerConfig,
    UserOptimizedTransformer,
    compare_outputs,
    generate_random_case,
    routing,
)

OFFICIAL = TOLERANCES["official"]
MASK_KINDS = ("none", "all_true", "prefix", "left", "holes", "one_empty")

# small configs: (B, S, d, H, ffn, L)
CFG_MAIN = (2, 33, 64, 4, 96, 2)  # head_dim 16, odd S
CFG_SEQ1 = (2, 1, 32, 2, 64, 1)  # S = 1
CFG_SEQ7 = (2, 7, 48, 3, 80, 1)  # head_dim 16, three heads
CFG_HD8 = (1, 33, 32, 4, 64, 1)  # head_dim 8


def cfg_of(t, causal=True):
    B, S, d, H, f, L = t
    return TransformerConfig(batch_size=B, seq_len=S, d_model=d, num_heads=H, ffn_dim=f, num_layers=L,
                             causal=causal)


def cpu_routes():
    """Names of the routes model.routing says serve a CPU tensor (read from the module, not hard-coded)."""
    names = []
    shape = TransformerConfig(batch_size=2, seq_len=8, d_model=32, num_heads=2, ffn_dim=64, num_layers=1, causal=True)
    for name in routing.ROUTES:
        try:
            r = routing.select_route(shape, torch.float32, torch.device("cpu"), "general", forced=name)
        except routing.RouteUnavailable:
            continue
        assert r.name == name
        names.append(name)
    return names


CPU_ROUTES = cpu_routes()


def make_mask(kind, B, S, device="cpu"):
    pos = torch.arange(S)
    if kind == "none":
        return None
    if kind == "all_true":
        m = torch.ones(B, S, dtype=torch.bool)
    elif kind == "prefix":
        lengths = torch.tensor([max(1, (S * 2) // 3)] + [S] * (B - 1))[:B]
        m = pos[None, :] < lengths[:, None]
    elif kind == "left":
        lengths = torch.tensor([max(1, S // 2)] + [S - 1 if S > 1 else 1] * (B - 1))[:B]
        m = pos[None, :] >= (S - lengths)[:, None]
    elif kind == "holes":
        g = torch.Generator().manual_seed(S)
        m = torch.rand(B, S, generator=g) < 0.6
        m[:, S // 2] = True
        if S > 2:
            m[0, 0] = False
    elif kind == "one_empty":
        m = torch.ones(B, S, dtype=torch.bool)
        m[0] = False
        if B > 1 and S > 2:
            m[1, S - 2:] = False
    else:
        raise AssertionError(kind)
    return m.to(device)


def make_inputs(cfg, mask_kind, dtype=torch.float32, seed=0):
    x, _ = generate_random_case(cfg, "cpu", torch.float32, seed)
    mask = make_mask(mask_kind, cfg.batch_size, cfg.seq_len)
    if mask is not None:
        x = x.masked_fill(~mask[..., None], 0.0)
    return x.to(dtype), mask


def build_pair(cfg, route="auto", seed=0, **kw):
    torch.manual_seed(seed)
    ref = BaselineTransformer(cfg).eval()
    # non-trivial LayerNorm parameters so that a kernel ignoring weight/bias cannot pass
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    opt = UserOptimizedTransformer(cfg, route=route, **kw).eval()
    opt.load_state_dict(ref.state_dict(), strict=True)
    return ref, opt




def cuda_case(cfg, mask_kind, **kw):
    """(optimized model on CUDA, x and mask on CUDA, the fp64 forward's output on the CPU, invalid rows 0)."""
    ref, opt = build_pair(cfg, "auto", **kw)
    x, mask = make_inputs(cfg, mask_kind)
    want = fp64_forward(ref.state_dict(), cfg, x, mask).nan_to_num(0.0).float()
    return opt.cuda(), x.cuda(), None if mask is None else mask.cuda(), want


def fp64_forward(state, cfg, x, mask=None):
    p = {k: v.detach().to(x.device, torch.float64) for k, v in state.items()}  # a GPU model's state, a CPU x
    x = x.detach().to(torch.float64)
    B, S, d = x.shape
    H = cfg.num_heads
    D = d // H
    keep = None if mask is None else mask[..., None].to(torch.float64)

    def ln(t, n):
        return F.layer_norm(t, (d,), p[n + ".weight"], p[n + ".bias"], 1e-5)

    def lin(t, n):
        return t @ p[n + ".weight"].T + p[n + ".bias"]

    for i in range(cfg.num_layers):
        pre = f"layers.{i}."
        h = ln(x, pre + "norm1")
        q, k, v = (lin(h, pre + f"attention.{n}_proj").view(B, S, H, D).transpose(1, 2) for n in "qkv")
        s = q @ k.transpose(-1, -2) / math.sqrt(D)
        allowed = torch.ones(B, 1, S, S, dtype=torch.bool)
        if cfg.causal:
            allowed &= torch.ones(S, S, dtype=torch.bool).tril()
        if mask is not None:
            allowed &= mask[:, None, None, :]
        s = s.masked_fill(~allowed, -math.inf)
        probs = torch.softmax(s, -1)
        # the reference's softmax of an all -inf row is NaN: keep NaN rows only where some key exists
        probs = torch.where(allowed.any(-1, keepdim=True), probs, torch.full_like(probs, math.nan))
        a = (probs @ v).transpose(1, 2).reshape(B, S, d)
        a = lin(a, pre + "attention.out_proj")
        if keep is not None:
            a = torch.where(keep.bool(), a, torch.zeros_like(a))
        x = x + a
        x = x + lin(F.gelu(lin(ln(x, pre + "norm2"), pre + "ffn_in")), pre + "ffn_out")
        if keep is not None:
            x = torch.where(keep.bool(), x, torch.zeros_like(x))
    x = ln(x, "final_norm")
    if keep is not None:
        x = torch.where(keep.bool(), x, torch.zeros_like(x))
    return x




def check_official(ref_out, opt_out, what):
    cmp = compare_outputs(ref_out, opt_out, rtol=OFFICIAL["rtol"], atol=OFFICIAL["atol"])
    assert cmp.failed_elements == 0, (f"{what}: {cmp.failed_elements}/{cmp.total_elements} failed, "
                                      f"max_abs={cmp.max_abs_error:.3e} worst={cmp.worst_index}")
    return cmp


