"""The optimized model's derived weights: operand-precision copies of its parameters, in each route's layout.

A table (one per operand precision and layout) is built on a route's first use, held as plain tensors (never
registered) and refreshed in place when a parameter's version counter moves (or, for a parameter that is not
watched, its storage address), so that captured CUDA graphs keep reading the same buffers. Seen: in-place edits
(`p.copy_`, `p.mul_` under no_grad), `p.data = t`, writes through `p.data` (`p.data.copy_(t)`: see
WatchedParameter), `load_state_dict` (also with assign=True) and `.to()`. Not seen, and so `refresh_weights()`
after them: a write through a `p.data` tensor taken before the previous forward, `torch.utils.swap_tensors` on a
parameter, and in-place edits of parameters that are inference tensors (created under torch.inference_mode: they
carry no version counter).

One counter for the model: the optimized model's parameters share one version counter (`share_one_counter`, at
construction), so that any seen edit of any parameter moves it and the per-call weight check reads one integer
instead of walking the parameters (docs/decisions.md#weight-version). Parameters that do not share it (a
`load_state_dict(assign=True)`, a deep copy, an unpickled model) are walked one by one, as correct and slower. The
cost of sharing: a backward pass through a graph that saved one parameter refuses to run after an in-place edit of
any other, as it would after an edit of that one.

The fp16 screen: for inputs that are not float16, a route's fp16 operands rest on every parameter lying within
FP16_SAFE_ABS; `DerivedWeights.fp16_offender` measures that once per weight version.
"""
from __future__ import annotations

import operator

import torch
from torch import nn

from ..kernels import OPERAND_DTYPES

# The largest parameter magnitude for which fp16 operands are used on an input that is not float16 (beyond it: bf16
# operands). fp16's largest finite value is 65504 (just under 2**16). LayerNorm's normalized activations are at most
# sqrt(d_model - 1) in magnitude, below 2**5 up to d_model 1024 (the widest official row); times a gain or a weight
# of at most 2**11, one such product stays within fp16's range. Real weights are orders of magnitude smaller
# (PyTorch initializes Linear weights within 1/sqrt(fan_in), LayerNorm gains at 1), so the check catches weights on
# another scale (unnormalized or rescaled checkpoints), not ordinary ones. It is a screen, not a proof: a sum of
# many large aligned products can still overflow, and shows as inf in the output.
FP16_SAFE_ABS = 2.0**11
# One layer's derived weights as the per-layer kernels (fused_layer, ln_qkv, layer_tail) take them: "{i}.{name}".
LAYER_WEIGHTS = ("qkv_w", "qkv_b", "o_w", "o_b", "in_w", "in_b", "out_w", "out_b", "n1_w", "n1_b", "n2_w", "n2_b")
_version_of = operator.attrgetter("_version")
_tensor_data = torch._C.TensorBase.data  # the descriptor WatchedParameter wraps


class WatchedParameter(nn.Parameter):
    """A parameter whose `.data`, once handed out or replaced, counts as written. PyTorch gives `p.data` a version
    counter of its own, so a write through it (`p.data.copy_(w)`) leaves `p._version` where it was, and derived
    weights keyed on it would stay stale; reading `.data` bumps `p._version` instead
    (torch.autograd.graph.increment_version, PyTorch's way to report a write it cannot see), and so does `p.data = t`
    (it swaps the storage and keeps the counter), so that the version counter alone tells every seen edit. Costs: a
    read that writes nothing rebuilds the derived weights once at the next forward, and, as after any in-place write,
    a backward pass through a graph that saved `p` before the read refuses to run. Nothing else differs from
    nn.Parameter. The model's parameters take this class once it derives weights from them (DerivedWeights.table)."""

    @property
    def data(self):
        torch.autograd.graph.increment_version(self)
        return _tensor_data.__get__(self)

    @data.setter
    def data(self, value):
        _tensor_data.__set__(self, value)
        torch.autograd.graph.increment_version(self)

    def __repr__(self):
        return repr(nn.Parameter(self.detach(), self.requires_grad))


def share_one_counter(module: nn.Module) -> None:
    """Give every parameter of `module` one version counter, keeping its storage, values and requires_grad: each
    becomes a new Parameter made from a view of one empty base (views share their base's counter) whose data is then
    set to the old parameter's (setting `.data` keeps the counter). For a module nobody holds parameters of yet (its
    constructor): the old Parameter objects are replaced."""
    params = [(mod, name, p) for mod in module.modules() for name, p in mod._parameters.items() if p is not None]
    if not params:
        return
    base = torch.empty(0, dtype=params[0][2].dtype, device=params[0][2].device)
    for mod, name, p in params:
        shared = nn.Parameter(base[:0], requires_grad=p.requires_grad)
        shared.data = p.detach()
        mod._parameters[name] = shared


def _one_counter(params) -> bool:
    """Whether `params` (not inference tensors) share one version counter: a bump of the first moves every one."""
    before = [p._version for p in params]
    torch.autograd.graph.increment_version(params[0])
    return all(p._version == v + 1 for p, v in zip(params, before))


def per_layer(model, dtype, packed: bool = True) -> dict:
    """The per-layer kernels' layout: "{i}.{name}" of LAYER_WEIGHTS (q/k/v_w, _b unpacked when not `packed`) in
    `dtype`, LayerNorm weights in fp32, and final_w, final_b."""
    out = {}
    for i, layer in enumerate(model.layers):
        a = layer.attention
        if packed:
            out[f"{i}.qkv_w"] = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).to(dtype)
            out[f"{i}.qkv_b"] = torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]).to(dtype)
        else:
            for n in ("q", "k", "v"):
                proj = getattr(a, f"{n}_proj")
                out[f"{i}.{n}_w"], out[f"{i}.{n}_b"] = proj.weight.to(dtype), proj.bias.to(dtype)
        for n, lin in (("o", a.out_proj), ("in", layer.ffn_in), ("out", layer.ffn_out)):
            out[f"{i}.{n}_w"], out[f"{i}.{n}_b"] = lin.weight.to(dtype), lin.bias.to(dtype)
        for n, norm in (("n1", layer.norm1), ("n2", layer.norm2)):
            out[f"{i}.{n}_w"], out[f"{i}.{n}_b"] = norm.weight.float(), norm.bias.float()
    out["final_w"], out["final_b"] = model.final_norm.weight.float(), model.final_norm.bias.float()
    return out


def unpacked_per_layer(model, dtype) -> dict:
    """per_layer with separate q, k and v projections (the packed_qkv switch off)."""
    return per_layer(model, dtype, packed=False)


def layer_weights(table: dict, i: int) -> dict:
    """Layer i's weights of a per_layer table, named as the per-layer kernels take them."""
    return {n: table[f"{i}.{n}"] for n in LAYER_WEIGHTS}


class DerivedWeights:
    """The derived weight tables of one model, their parameters' versions and the fp16 screen's verdict.

    Holds no reference to the model (each method takes it), so that dropping the model frees its tables at once.
    """

    __slots__ = ("params", "inference", "shared", "aliases", "unwatched", "versions", "tables", "screen")

    def __init__(self):
        self.params = None  # the parameters, listed once: the module tree is too slow to walk on every call
        self.inference = False  # some parameter is an inference tensor: only addresses count
        self.shared = False  # every parameter shares one version counter (share_one_counter): it alone is read
        self.aliases = ()  # a plain tensor per watched parameter, sharing its version counter (see `now`)
        self.unwatched = ()  # the parameters that are no WatchedParameter: their addresses count too
        self.versions = None  # the weights' identity (`now`) the tables were derived from
        self.tables = {}  # (precision, layout) -> {name: tensor}
        self.screen = None  # the last fp16 screen: (versions, offender); None: no route asked for one

    def relist(self) -> None:
        """Forget the parameter list (load_state_dict with assign=True swaps Parameter objects)."""
        self.params = None

    def now(self, model):
        """Cheap identity of the weights: each parameter's version counter, and the storage address of each one that
        is not watched (a WatchedParameter's storage swap bumps its counter). The counters are read through aliases,
        plain tensors that share them, since a Parameter subclass's attributes take ~3x as long to read: on the
        launch-bound rows this check is the forward's largest host cost (docs/decisions.md#weight-check)."""
        if self.params is None:
            self._list(model)
        if self.inference:
            return tuple(map(torch.Tensor.data_ptr, self.params))
        unwatched = self.unwatched
        if self.shared and not unwatched:  # the model-wide counter: every seen edit moves it
            return self.aliases[0]._version
        return (tuple(map(_version_of, self.aliases)), tuple(map(torch.Tensor.data_ptr, unwatched)),
                tuple(map(_version_of, unwatched)))

    def _list(self, model) -> None:
        self.params = list(model.parameters())
        self.inference = any(p.is_inference() for p in self.params)
        self.shared = bool(self.params) and not self.inference and _one_counter(self.params)
        if self.tables:
            _watch(self.params)
        self._alias()

    def _alias(self) -> None:
        """Aliases of the watched parameters' current storages, taken again after each edit (none holds a replaced
        storage); the other parameters are read themselves. With one shared counter, one alias reads it."""
        watched = [p for p in self.params if isinstance(p, WatchedParameter)]
        self.aliases = tuple(p.detach() for p in (watched[:1] if self.shared else watched))
        self.unwatched = tuple(p for p in self.params if not isinstance(p, WatchedParameter))

    def moved(self, model) -> bool:
        """Whether the weights moved since the tables were derived (`refresh` derives them again)."""
        return self.now(model) != self.versions

    def refresh(self, model) -> bool:
        """Derive every table again, in place, when the weights moved since they were derived; measure the fp16
        screen again where a route asked for it. True when its verdict changed: the caller then drops the routes
        chosen under the old one (the tables of its precision are dropped here)."""
        versions = self.now(model)
        if versions == self.versions:
            return False
        self._alias()
        with torch.inference_mode(False), torch.no_grad():
            for (precision, layout), table in self.tables.items():
                for name, fresh in layout(model, OPERAND_DTYPES[precision]).items():
                    table[name].copy_(fresh)  # in place: captured graphs keep reading the same buffers
        self.versions = versions
        if self.screen is None:
            return False
        return self.fp16_offender(model, versions)[1]

    def forget(self) -> None:
        """Drop everything derived (the model moved: .to(), .cuda(), .half()); rebuilt on the next use."""
        self.__init__()

    def table(self, model, precision: str, layout) -> dict:
        """The `layout(model, dtype)` table in `precision`'s operand dtype, built on first use."""
        key = (precision, layout)
        table = self.tables.get(key)
        if table is None:
            if not self.tables:
                self._start_watching(model)
            with torch.inference_mode(False), torch.no_grad():
                table = {k: v.contiguous().clone() for k, v in layout(model, OPERAND_DTYPES[precision]).items()}
            self.tables[key] = table
        return table

    def _start_watching(self, model) -> None:
        """Make the parameters WatchedParameters (the first table's build). The identity's form changes (watched
        parameters' addresses leave it), not the weights it names: the readings taken before carry over."""
        before = self.now(model)
        _watch(self.params)
        self._alias()
        after = self.now(model)
        if self.versions == before:
            self.versions = after
        if self.screen is not None and self.screen[0] == before:
            self.screen = (after, self.screen[1])

    def fp16_offender(self, model, versions=None):
        """((name, max |value|) of the parameter furthest beyond FP16_SAFE_ABS, or None when all lie within it;
        whether that verdict differs from the previous one).

        Measured once per weight version (one host sync). A changed verdict drops the tables (a route of the other
        precision may take their place)."""
        versions = self.now(model) if versions is None else versions  # the caller's reading of the weights now
        if self.screen is not None and self.screen[0] == versions:
            return self.screen[1], False
        named = list(model.named_parameters())
        with torch.no_grad():
            peaks = torch.stack([p.detach().abs().amax().float() for _, p in named]).tolist()  # the host sync
        worst = max(range(len(named)), key=peaks.__getitem__)
        offender = (named[worst][0], peaks[worst]) if peaks[worst] > FP16_SAFE_ABS else None
        changed = self.screen is not None and _name_of(self.screen[1]) != _name_of(offender)
        if changed:
            self.tables = {}
        self.screen = (versions, offender)
        return offender, changed

    def mark_stale(self) -> None:
        """Make the next refresh derive every table and measure the screen again (refresh_weights)."""
        self.params, self.versions = None, None
        if self.screen is not None:  # versions that cannot match: the range is measured again
            self.screen = (None, self.screen[1])


def _name_of(offender):
    return None if offender is None else offender[0]


def _watch(params) -> None:
    """Make `params` WatchedParameters (in place: the same objects, so every reference to them stays valid). Not
    inference tensors: they have no version counter to bump, and their storage swaps show in their addresses."""
    for p in params:
        if type(p) is nn.Parameter and not p.is_inference():
            p.__class__ = WatchedParameter
