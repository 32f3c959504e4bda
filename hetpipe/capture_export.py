"""The ``torch.export`` route of :mod:`hetpipe.capture`: models ``torch.fx`` cannot trace.

Hugging Face transformers models take ``**kwargs`` and build their attention masks by control
flow on shapes, which symbolic tracing cannot follow; ``torch.export`` runs the forward on
fake tensors instead, so it follows that control flow for one example batch. The example is
made from the model's configuration (``input_ids`` and ``labels`` of ``[2, 8]`` token ids
below ``vocab_size``, ``use_cache=False``) on the module's own device (the meta device where
the runtime builds it), with the batch and sequence dimensions dynamic: the graph holds for
any batch size and any sequence length up to ``max_position_embeddings``. Its operations are
ATen operators; each carries the submodule it ran in (``nn_module_stack``), which is how
:func:`hetpipe.capture._cut` finds the natural units (the embedding, each decoder layer,
the final norm, the output head). The parameters stay the user's own (same objects), so
state keys map back to the library model's and a tied head works as in the fx route.

What the exported graph fixes at capture: the batch's inputs (``input_ids`` and ``labels``:
a batch with other keys, an ``attention_mask`` among them, is refused when it is bound),
``use_cache=False``, and the training mode (dropout as the module was built, in train mode).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, fx, nn
from torch.utils import _pytree as pytree

__all__: list[str] = []

# the example batch's shape: two rows of eight tokens (dynamic: any batch, any length)
EXAMPLE = (2, 8)
# operators that only check what export saw (device, dtype, value ranges): dropped
_CHECKS = ("_assert_tensor_metadata", "_assert_scalar", "sym_constrain_range")


class ExportFailure(Exception):
    """``torch.export`` refused the module; ``str(e)`` is one line naming the operation."""


class Unflatten(nn.Module):
    """The last block's outputs, flat, back into the model's own output (a ``ModelOutput``)."""

    def __init__(self, spec: pytree.TreeSpec) -> None:
        super().__init__()
        self.spec = spec

    def forward(self, values: tuple) -> Any:
        return pytree.tree_unflatten(list(values), self.spec)


def device_of(*values: Any) -> torch.device:
    """The device of the first tensor among ``values`` (a block's carry or batch): where a
    block makes its new tensors (``arange``, masks), whatever device export saw."""
    for leaf in pytree.tree_leaves(values):
        if isinstance(leaf, Tensor):
            return leaf.device
    return torch.device("cpu")


def example_inputs(module: nn.Module) -> tuple[dict[str, Any], dict[str, Any]]:
    """The example keyword inputs of a causal language model and their dynamic shapes."""
    config = getattr(module, "config", None)
    vocab = int(getattr(config, "vocab_size", 2) or 2)
    longest = int(getattr(config, "max_position_embeddings", 0) or 0) or 4096
    param = next(module.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    rows, length = EXAMPLE[0], min(EXAMPLE[1], longest)
    # made without the global generator, whose state a capture must not move (construction
    # draws from it, and a cached capture exports nothing)
    ids = torch.arange(rows * length, device=device).reshape(rows, length) % vocab
    labels = (ids + 1) % vocab  # another tensor: export would bind one tensor to both names
    batch = torch.export.Dim("batch", min=1, max=1 << 20)
    seq = torch.export.Dim("seq", min=2, max=max(longest, 3))
    dims = {0: batch, 1: seq}
    kwargs = {"input_ids": ids, "labels": labels, "use_cache": False}
    return kwargs, {"input_ids": dims, "labels": dims, "use_cache": None}


def export_graph(module: nn.Module) -> tuple[fx.GraphModule, list[str], set[str]]:
    """``module`` exported: a graph module whose ``get_attr`` nodes hold ``module``'s own
    parameters and buffers, with forward's input names and the constant ones among them.
    Raises :class:`ExportFailure` where ``torch.export`` cannot export it."""
    kwargs, dynamic = example_inputs(module)
    try:
        program = torch.export.export(module, (), kwargs, dynamic_shapes=dynamic, strict=False)
        try:
            root = program.module(check_guards=False)  # the inputs are bound by name instead
        except TypeError:  # a torch without guard checks
            root = program.module()
    except Exception as exc:  # any failure is the model's: name what export said
        text = str(exc).strip().splitlines()
        raise ExportFailure(
            f"torch.export cannot export it: {type(exc).__name__}: {text[0] if text else ''}"
        ) from None
    graph = root.graph
    for n in list(graph.nodes):
        if n.op == "get_attr":
            _own(root, module, str(n.target))
        elif n.op == "call_function" and not n.users and any(c in str(n.target) for c in _CHECKS):
            graph.erase_node(n)
    for sub in root.modules():  # subgraphs of higher-order operators (no_grad regions)
        if isinstance(sub, fx.GraphModule) and sub is not root:
            place_on_inputs(sub.graph)
            sub.recompile()
    spec = graph._codegen.pytree_info.out_spec  # the model's output structure
    root.hetpipe_output = Unflatten(spec)
    out = next(n for n in graph.nodes if n.op == "output")
    with graph.inserting_before(out):
        rebuilt = graph.call_module("hetpipe_output", (out.args[0],))
    out.args = (rebuilt,)
    graph.set_codegen(fx.graph.CodeGen())  # plain inputs and outputs, as the blocks take
    names = [str(n.target) for n in graph.nodes if n.op == "placeholder"]
    constant = {k for k, v in kwargs.items() if not isinstance(v, Tensor)}
    return root, names, constant


def _own(root: nn.Module, module: nn.Module, target: str) -> None:
    """Make ``root``'s attribute ``target`` the user's own tensor of that name, where the user's
    module has one (the state keys and ties then are the user's)."""
    path, _, field = target.rpartition(".")
    try:
        theirs = getattr(module.get_submodule(path), field)
        owner = root.get_submodule(path)
    except AttributeError:
        return
    if not isinstance(theirs, Tensor) or getattr(owner, field, None) is theirs:
        return
    if isinstance(theirs, nn.Parameter):
        owner._parameters[field] = theirs
    elif field in owner._buffers:
        owner._buffers[field] = theirs


def unit_of_node(node: fx.Node) -> str | None:
    """The innermost submodule an exported operation ran in (its ``nn_module_stack``)."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    path = str(list(stack.values())[-1][0])
    path = path.removeprefix("L['self']").lstrip(".")
    return path or None


def place_on_inputs(graph: fx.Graph) -> None:
    """Every device ``graph`` names (the device export saw) becomes the device of its first
    input at run time, so that a block built on the meta device runs where it is placed."""
    fixed = [n for n in graph.nodes if _names_device(n)]
    if not fixed:
        return
    inputs = [n for n in graph.nodes if n.op == "placeholder"]
    anchor = inputs[-1] if inputs else next(iter(graph.nodes))
    with graph.inserting_after(anchor):
        dev = graph.call_function(device_of, tuple(inputs))
    swap: Callable[[Any], Any] = lambda a: dev if isinstance(a, torch.device) else a  # noqa: E731
    for n in fixed:
        n.args = tuple(swap(a) for a in n.args)
        n.kwargs = {k: swap(v) for k, v in n.kwargs.items()}


def _names_device(node: fx.Node) -> bool:
    return any(isinstance(a, torch.device) for a in (*node.args, *node.kwargs.values()))


def cache_key(module: nn.Module, starts_at: Sequence[str], split: bool) -> Any:
    """What an exported cut depends on: the model's class, its configuration (as JSON), the
    units and the training mode; ``None`` for a model without a configuration (not kept)."""
    config = getattr(module, "config", None)
    to_json = getattr(config, "to_json_string", None)
    if not callable(to_json):
        return None
    cls = type(module)
    return (cls.__module__, cls.__qualname__, to_json(), tuple(starts_at), split, module.training)


def rebind(
    root: nn.Module, module: nn.Module, graphs: Sequence[fx.Graph], *, own: bool = True
) -> nn.Module:
    """A root for the blocks of ``graphs``: each attribute they read is ``module``'s own tensor
    of that name where it has one (a new build of the same model), else ``root``'s (what
    export made: no-grad subgraphs, the output's structure). With ``own=False`` the module's
    tensors are left out: what a kept cut holds, so that it keeps no model's weights alive."""
    fresh = nn.Module()
    for g in graphs:
        for n in g.nodes:
            if n.op not in ("get_attr", "call_module"):
                continue
            target = str(n.target)
            path, _, field = target.rpartition(".")
            try:
                value = getattr(module.get_submodule(path), field)
                if not isinstance(value, Tensor):
                    raise AttributeError(target)
                if not own:
                    continue
            except AttributeError:
                value = getattr(root.get_submodule(path), field)
            owner = fresh
            for part in path.split(".") if path else []:
                if not hasattr(owner, part):
                    owner.add_module(part, nn.Module())
                owner = getattr(owner, part)
            if isinstance(value, nn.Parameter):
                owner.register_parameter(field, value)
            elif isinstance(value, Tensor):
                owner.register_buffer(field, value)
            else:
                owner.add_module(field, value)
    return fresh


def copy_graph(graph: fx.Graph) -> fx.Graph:
    """A copy of a block's graph, for one block module (a graph has one owner)."""
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    out = new.graph_copy(graph, env)
    new.output(out)
    return new


def own_constants(seq: nn.Sequential, module: nn.Module) -> None:
    """Give each block its own copy of a buffer the user's state does not hold (a
    non-persistent constant such as rotary frequencies): the blocks share no such tensor, so
    no tie is made of it; each copy is the block's own state."""
    persistent = {id(t) for t in module.state_dict(keep_vars=True).values()}
    for block in seq:
        for name, buf in list(block.named_buffers()):
            if id(buf) in persistent:
                continue
            path, _, field = name.rpartition(".")
            block.get_submodule(path)._buffers[field] = buf.clone()
