"""A route's forward captured in CUDA graphs, one set per input signature: routes `graph` and `fused` on CUDA.

Each call copies its inputs into the capture's static tensors, replays the graph and clones the static output (the
graph's own buffer is never handed out); with `eager_tail` the graph ends before the forward's last kernel (the
runner's `stage`), which each call then launches after the replay into a new output (its `finish`), so nothing is
copied out. Once a caller passes the same tensors twice in a row (a benchmark loop, a
serving loop with fixed buffers), a second graph that reads them in place is captured: correct for whatever the
caller passes at those addresses with that layout, since a replay reads the memory the arguments live in now.
"""
from __future__ import annotations

import torch

MAX_GRAPHS = 8  # input signatures whose captures a model keeps (beyond them, the oldest capture goes)


class Captures:
    """The captured forwards of one model that hold graphs, oldest first: at most MAX_GRAPHS of them."""

    __slots__ = ("holders",)

    def __init__(self):
        self.holders = []

    def admit(self, holder) -> None:
        if len(self.holders) >= MAX_GRAPHS:  # many input shapes: drop the oldest capture and its memory
            self.holders.pop(0).release()
        self.holders.append(holder)

    def clear(self) -> None:
        for holder in self.holders:
            holder.release()
        self.holders = []


class CapturedForward:
    """`inner` (a route's runner) for one input signature, captured on its first call and replayed after."""

    uses_weights = True
    __slots__ = ("inner", "route", "captures", "direct_input", "eager_tail", "copy", "direct", "last_inputs")

    def __init__(self, inner, captures: Captures, direct_input: bool, eager_tail: bool = False):
        self.inner, self.route, self.captures, self.direct_input = inner, inner.route, captures, direct_input
        self.eager_tail = eager_tail
        self.release()

    def release(self) -> None:
        self.copy = None  # (graph, static x, static mask, static output): reads copies each call fills
        self.direct = None  # (graph, the inputs' addresses, static output): reads the caller's tensors in place
        self.last_inputs = None  # the addresses of the previous call's inputs

    def __call__(self, model, x, mask):
        inputs = _addresses(x, mask)
        direct = self.direct
        if direct is not None and direct[1] == inputs:
            direct[0].replay()  # reads the caller's x and mask where they are: no copy in
            return self._output(model, direct[2])
        if self.copy is None:
            self.captures.admit(self)  # the oldest capture goes first: its memory is free for this one
            self.copy = self._capture(model, x, mask, direct=False)
        if inputs == self.last_inputs and inputs is not None and self.direct_input:
            graph, _, _, out = self._capture(model, x, mask, direct=True)
            self.direct = (graph, inputs, out)
            graph.replay()
            return self._output(model, out)
        self.last_inputs = inputs
        graph, static_x, static_mask, static_out = self.copy
        static_x.copy_(x)
        if mask is not None:
            static_mask.copy_(mask)
        graph.replay()
        return self._output(model, static_out)

    def _output(self, model, static_out):
        """A new output from what the replay left: the last kernel's launch on the staged tensors (it follows the
        replay in the same stream, so the next replay cannot overwrite them first), or a copy of the graph's own."""
        if self.eager_tail:
            return self.inner.finish(model, static_out)
        return static_out.clone()

    def _capture(self, model, x, mask, direct):
        """A CUDA graph of one forward. direct=False: it reads static copies that each call fills; direct=True:
        it reads `x` and `mask` themselves (contiguous tensors whose addresses the caller repeats)."""
        with torch.inference_mode(False), torch.no_grad():
            if direct:
                static_x, static_mask = x, mask
            else:
                static_x = x.detach().clone(memory_format=torch.contiguous_format)
                static_mask = None if mask is None else mask.detach().clone(memory_format=torch.contiguous_format)
            side = torch.cuda.Stream(device=x.device)
            side.wait_stream(torch.cuda.current_stream(x.device))
            with torch.cuda.stream(side):  # compile, autotune and warm the allocator outside the capture
                for _ in range(1 if direct else 2):
                    self.inner(model, static_x, static_mask)
            torch.cuda.current_stream(x.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            captured = self.inner.stage if self.eager_tail else self.inner
            with torch.cuda.graph(graph):
                static_out = captured(model, static_x, static_mask)  # with eager_tail: the staged tensors
        return graph, static_x, static_mask, static_out


def _addresses(x, mask):
    """Where the inputs live and how they are laid out, when a graph may read them in place; else None."""
    if not x.is_contiguous() or (mask is not None and not mask.is_contiguous()):
        return None
    return x.data_ptr(), None if mask is None else mask.data_ptr()
