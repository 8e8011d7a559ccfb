"""q/k/v and gate/up as one matmul each in a compiled forward, with no copy of the weights.

A decode step is a matrix-vector product a projection, and on a GPU each is a kernel: a layer of a Llama runs seven.
Inductor's freezing joins the projections that read the same input (q/k/v, gate/up) into one matmul each, three
fewer kernels a layer (GPU run 4: 0.85x the time a token on the SmolLM2-1.7B shape), but it concatenates copies of
those weights (70 % of the model again). `fuse_projections` instead moves each group's weights into one tensor, the
modules' own weights becoming views of it (the same names, shapes and values: nothing else sees a change), and each
module a `FusedPart`: eagerly it multiplies by its own rows, as before; while torch.compile traces, by the whole
group's tensor, sliced. The group's identical products, one a module, are one node after `SameProducts` (an inductor
graph pass, `OPTIONS`), so the compiled forward runs one matmul a group.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
JOINING = False  # set by `joining()`: a trace may use the group's product (compiled with `OPTIONS`)


class FusedPart(nn.Module):
    """A linear layer whose weight is rows `start:stop` of its group's (`whole`, kept off the module's parameters)."""

    def __init__(self, linear: nn.Linear, whole: list[torch.Tensor | None], start: int, stop: int):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = nn.Parameter(whole[0][start:stop], requires_grad=False)
        self.bias = None if whole[1] is None else nn.Parameter(whole[1][start:stop], requires_grad=False)
        self._whole, self.start, self.stop = whole, start, stop  # (a list: not a registered parameter)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if JOINING and torch.compiler.is_compiling():  # (dynamo guards on `JOINING`: a trace outside is its own)
            return nn.functional.linear(x, *self._whole)[..., self.start:self.stop]
        return nn.functional.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, rows {self.start}:{self.stop}"


def fuse_projections(model: nn.Module) -> int:
    """Join each group of `GROUPS` (plain `nn.Linear`s of one input size, all with a bias or none, on one device and
    dtype) into one weight tensor, in place; how many groups. Run it once the model is where it runs (`.to` after
    it would copy the views apart). A group already joined, or with an adapter, is left as it is."""
    joined = 0
    for module in list(model.modules()):
        for names in GROUPS:
            parts = [getattr(module, name, None) for name in names]
            if not all(type(p) is nn.Linear for p in parts):  # (a FusedPart, a LoRA layer, a quantised one: left)
                continue
            first = parts[0]
            if len({(p.in_features, p.bias is None, p.weight.device, p.weight.dtype) for p in parts}) != 1:
                continue
            with torch.no_grad():
                whole = [nn.Parameter(torch.cat([p.weight for p in parts]), requires_grad=False),
                         None if first.bias is None else
                         nn.Parameter(torch.cat([p.bias for p in parts]), requires_grad=False)]
            for t in whole:  # (not the module's parameters: torch.compile's CUDA graphs must not copy them in)
                if t is not None:
                    torch._dynamo.mark_static_address(t)
            start = 0
            for name, p in zip(names, parts):
                setattr(module, name, FusedPart(p, whole, start, start + p.out_features))
                start += p.out_features
            joined += 1
    return joined


class SameProducts(CustomGraphPass):
    """Inductor's post-grad pass that keeps one of identical pure nodes (the same op on the same inputs): a fused
    group's products, and their views and transposes. Only ops without side effects are merged."""

    PURE = frozenset({torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
                      # (a one-row product as inductor decomposes it with coordinate-descent tuning: `graph_compile.MATVEC`)
                      torch.ops.aten.mul.Tensor, torch.ops.aten.sum.dim_IntList, torch.ops.aten.add.Tensor,
                      torch.ops.prims.convert_element_type.default, torch.ops.aten._to_copy.default,
                      torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten.permute.default,
                      torch.ops.aten.t.default, torch.ops.aten.expand.default, torch.ops.aten.unsqueeze.default,
                      torch.ops.aten._unsafe_view.default, torch.ops.aten.clone.default})

    def __call__(self, graph: torch.fx.Graph) -> None:
        seen: dict[Any, torch.fx.Node] = {}
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target not in self.PURE:
                continue
            key = (node.target, _key(node.args), _key(node.kwargs))
            if (kept := seen.get(key)) is not None:
                node.replace_all_uses_with(kept)
                graph.erase_node(node)
            else:
                seen[key] = node

    def uuid(self) -> bytes:
        return get_hash_for_files((__file__,))


def _key(value: Any) -> Any:
    """A hashable form of a node's arguments (nodes by identity)."""
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, *(_key(v) for v in value))
    if isinstance(value, dict):
        return tuple(sorted((k, _key(v)) for k, v in value.items()))
    if isinstance(value, torch.fx.Node):
        return ("node", id(value))
    if isinstance(value, (torch.dtype, torch.device, torch.memory_format, torch.layout)):
        return str(value)
    if isinstance(value, float):  # (by type, so that x * 2 and x * 2.0 stay apart; repr: -0.0 is not 0.0)
        return "float", repr(value)
    return (type(value).__name__, value) if value is None or isinstance(value, (int, bool, str)) \
        else ("object", id(value))


OPTIONS = {"post_grad_custom_pre_pass": SameProducts()}  # torch.compile's options for a forward of fused groups


def joining(fn: Callable) -> Callable:
    """`fn` (compiled with `OPTIONS`), called so that its trace uses each group's one product: any other compile
    of the same modules (without the pass, which would run the group's product once a module) uses their own rows."""
    def call(*args, **kwargs):
        global JOINING
        JOINING = True
        try:
            return fn(*args, **kwargs)
        finally:
            JOINING = False
    return call
