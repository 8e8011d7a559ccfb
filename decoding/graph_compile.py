"""How the graph step's forwards are compiled (`decoding/graph.py`): the options that change the kernels a step runs,
not what it computes.

`freeze`: the one-position forward (the decode step; not the span graphs) compiled with inductor's freezing: the
weights are constants, so q/k/v and gate/up each run as one matmul (inductor's concat-linear patterns), three fewer
kernels a layer, at the cost of a copy of those weights (about 2/3 of a Llama's) that the frozen graph keeps.
Freezing folds every static input into a constant, so the step's mutable state (the cache, its length, the mRoPE
offset, the rows' mask) is then a plain input, not a static address (`GraphStep._mark_state`).

`fuse`: the same joined products without the copy (`decoding.fused`): each group's weights moved into one tensor, in
place (the modules' weights its views), and every forward of the step compiled to one matmul a group.

`matvec`: how the compiled forwards multiply a row by a weight: "cublas" (cuBLAS's kernels, one a product) or "triton"
(inductor's coordinate-descent tuning, which turns a one-row product into a Triton reduction that it fuses with its
neighbours and tunes: fewer, shorter kernels for a small model's small matrices, slower than cuBLAS on large ones; a
longer compile: only the one-position forward is compiled so); "auto": triton for a hidden size up to `MATVEC_AUTO`
on CUDA. A step of several rows is cuBLAS's whatever it says (its products are matrix ones).

`autotune`: the forwards compiled with inductor's max-autotune: each product is the fastest of cuBLAS's kernel and
Triton's matmul templates (timed with the elementwise work inductor fuses into a template: an activation, a
residual's add after it), and the Triton kernels' configurations are searched wider. Aimed at the products `matvec`
leaves to cuBLAS: a recall's span (its 17 rows; GPU run 5's 135M span ran 622 kernels, 150 of them cuBLAS's
products, where the step with Triton's reductions ran 463) and a large model's decode step (run 5's plain 1.7B step
spent 1.4 of its 1.87 ms of kernels in cuBLAS's products, at 1.5-3.2 TB/s of the card's 4.8). A one-row product
that `matvec="triton"` turns into a reduction is no product to choose a kernel for, but its reduction's
configuration is searched too. A longer compile (every candidate is timed once).

`gqa`: "repeat" (transformers' SDPA: a grouped-query layer copies its key/value heads once a query head before
attending) or "packed" (`decoding.gqa`: the query heads of a step or a span that share a key/value head attend as the
rows of one attention over it, no copy; the model's attention implementation becomes `decoding.gqa.PACKED`, for every
path and every step on the model: SDPA's own but for up to `decoding.gqa.MAX_POSITIONS` positions). A model without
grouped-query layers, or not on SDPA, keeps its own.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch

from decoding.fused import OPTIONS as FUSED, joining
from decoding.gqa import PACKED, pack

MATVEC = ("auto", "cublas", "triton")  # `GraphStep(matvec=)`
GQA = ("repeat", "packed")  # `GraphStep(gqa=)`
MATVEC_AUTO = 1024  # the largest hidden size "auto" multiplies with Triton (faster at 576, slower at 2048: docs/gpu)


def matvec_of(matvec: str, device: torch.device, batch: int, hidden_size: int) -> str:
    """"cublas" or "triton": what `matvec` means for a step of `batch` rows of this hidden size on `device`."""
    if matvec not in MATVEC:
        raise ValueError(f"matvec is {matvec!r}; allowed: {', '.join(MATVEC)}")
    if batch > 1:  # (rows multiply matrices: no one-row product there)
        return "cublas"
    if matvec == "auto":
        return "triton" if device.type == "cuda" and hidden_size <= MATVEC_AUTO else "cublas"
    return matvec


def gqa_of(config, gqa: str) -> str:
    """The text model of `config` packed if `gqa` asks and it has grouped-query layers on SDPA (`decoding.gqa.pack`);
    "packed" or "repeat": what the model does now (a step built earlier on it may have packed it)."""
    if gqa not in GQA:
        raise ValueError(f"gqa is {gqa!r}; allowed: {', '.join(GQA)}")
    shared = getattr(config, "num_key_value_heads", None)
    if gqa == "packed" and shared and shared < config.num_attention_heads:
        pack(config)
    return "packed" if getattr(config, "_attn_implementation", None) == PACKED else "repeat"


def forwards(forward: Callable, *, mode: str, device: torch.device, fuse: bool, freeze: bool, matvec: str,
             autotune: bool, freezing: Callable[[], bool]) -> tuple[Callable, Callable]:
    """(the forward of the span graphs, the one-position forward), `forward` compiled by inductor (`mode` "trees":
    with torch.compile's CUDA graphs; `autotune`: its products autotuned); the latter frozen (`freeze`, frozen only
    while `freezing()` says the warm-up compiles) or tuned (`matvec="triton"`: only a one-position forward has
    one-row products to turn into reductions) in a compile of its own."""
    # (torch.compile takes a mode or options: "reduce-overhead" is {"triton.cudagraphs": True})
    autotuned = {"max_autotune": True} if autotune else {}
    options = {**({"triton.cudagraphs": True} if mode == "trees" else {}), **(FUSED if fuse else {}), **autotuned}
    wrap = joining if fuse else (lambda f: f)
    fn = wrap(torch.compile(forward, dynamic=False, options=options or None))
    tuned = {"coordinate_descent_tuning": True} if matvec == "triton" else {}
    if not freeze:
        return fn, wrap(torch.compile(forward, dynamic=False, options={**options, **tuned})) if tuned else fn
    frozen_options = {"freezing": True}
    if device.type == "cpu":  # (the same concatenation on a CPU, where the tests check the frozen step)
        frozen_options["cpp.enable_concat_linear"] = True
    frozen = torch.compile(forward, dynamic=False, options={**frozen_options, **tuned, **autotuned})  # (its own)

    def one(*inputs):
        # dynamo reads the global setting as it traces (to lift the weights as constants), so it is set too, but
        # only while the warm-up compiles, under `TRACING`: before torch 2.12 the setting is the process's, and a
        # compile of another step in that moment (its cache marked static) would fold its cache. A compile after
        # the warm-up (a missed guard) is not frozen: slower, not wrong.
        with torch._inductor.config.patch(frozen_options) if freezing() else contextlib.nullcontext():
            return frozen(*inputs)
    return fn, one
