"""Any ``nn.Module`` as an ``nn.Sequential`` of blocks, the shape the runtime cuts between.

The runtime cuts a model by element index, so a module that is not already a flat
``nn.Sequential`` is captured: :mod:`torch.fx` traces its forward symbolically (no real
computation, so it works on the meta device) with the natural units as leaves, and the graph
is cut into one block per unit, each an :class:`torch.fx.GraphModule` holding the user's own
submodules and parameters (same objects: a weight tied between two blocks is one Parameter).

The natural units: the top-level children, and each element of a top-level or nested
``nn.ModuleList``/``nn.Sequential`` (transformer layers, residual stages); a child holding such
a container is opened, the rest are leaves. ``split_points`` (``model.split_points``) names the
submodules that start a block instead; a block also holds the glue after its unit (residual
adds, reshapes, masks).

**The carry contract** (the runtime's side is :mod:`hetpipe.stage`): every block takes one
positional argument, the carry, and returns the next one. A carry is a bare Tensor where one
tensor crosses that cut, else a tuple of Tensors in program order; each block returns exactly
the values later blocks use. The first block takes the model's inputs: a Tensor (one input), a
tuple (positional, in forward's order) or a Mapping by parameter name (``forward(**batch)``;
a parameter left out takes its default). The last block returns the output as the model does.
Values that are not tensors (``x.size(0)``, shapes, dtypes), parameters and constants never
cross a cut: each block that uses one computes it again from what it has, and a capture where
that is impossible is refused.

Limits of the fx route: control flow on tensor values cannot be traced; a parameter
with a default other than ``None`` (a flag) is fixed at its default; a ``None``-default
parameter is traced as given (a batch that leaves it out passes ``None``); ``self.training``
branches outside the leaf modules are taken as they are at capture; ``*args``/``**kwargs``
are refused. fx is the route for the user's own modules because it needs no example inputs,
which the meta construction does not have.

**The torch.export route** (:mod:`hetpipe.capture_export`): Hugging Face transformers models
take ``**kwargs`` and build their attention masks by control flow on shapes, which fx cannot
trace (transformers 5 has no fx tracer of its own). They are exported with an example batch
made from their configuration, with a dynamic batch size and sequence length, and the ATen
graph is cut by the same rules at the same units, each operation's unit told by the
submodule it ran in; a symbolic size a block needs is read again from a tensor entering
that block.
"""

from __future__ import annotations

import builtins
import inspect
import linecache
import operator
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, fx, nn

from hetpipe import capture_export

__all__ = ["Capture", "CaptureError", "capture", "capture_of", "user_state"]

# methods and attributes of a tensor that give a non-tensor value (recomputed, never carried)
_META_METHODS = frozenset({"size", "dim", "numel", "nelement", "element_size", "stride"})
_META_ATTRS = frozenset({"shape", "ndim", "dtype", "device", "is_cuda", "requires_grad"})
# functions that draw random numbers: their results are carried, never computed twice
_RANDOM = ("rand", "dropout", "bernoulli", "normal", "multinomial")
_TORCH_DIR = os.path.dirname(torch.__file__)


class CaptureError(ValueError):
    """A module cannot be captured; ``str(e)`` is one line saying where and why."""


@dataclass(frozen=True)
class Capture:
    """What a capture learnt beside its blocks.

    ``source`` is the module the factory returned (its parameters are the blocks' own);
    ``starts`` the submodule each block starts at (``""`` for the first block's inputs);
    ``carries`` the names of the values entering each block (block 0: forward's inputs);
    ``keys`` each state-dict key of the blocks with the user's key for the same tensor, and
    ``user_keys`` each user key with one blocks' key holding its tensor (ties included), or
    ``None`` for a tensor forward never uses.
    """

    source: nn.Module
    starts: tuple[str, ...]
    carries: tuple[tuple[str, ...], ...]
    keys: dict[str, str]
    user_keys: dict[str, str | None]


def capture_of(model: nn.Module) -> Capture | None:
    """The :class:`Capture` of a captured ``nn.Sequential``; ``None`` for any other module."""
    found = model.__dict__.get("_hetpipe_capture")
    return found if isinstance(found, Capture) else None


def user_state(model: nn.Sequential, state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``state`` (keyed as the captured ``model``) keyed as the user's own module, ties as the
    user's module has them; it loads with ``strict=True`` into the module the factory returns.

    A tensor forward never uses takes the user's module's own value (as the factory built it).
    A plain ``nn.Sequential`` is its own user module: ``state`` comes back as it is.
    """
    cap = capture_of(model)
    if cap is None:
        return dict(state)
    own = cap.source.state_dict()
    return {u: state[c] if c is not None else own[u] for u, c in cap.user_keys.items()}


# --------------------------------------------------------------------------- units


_CONTAINERS = (nn.ModuleList, nn.Sequential)


def natural_units(module: nn.Module) -> list[str]:
    """The default units of ``module``, as submodule paths in module order: its children,
    each element of a container (``ModuleList``/``Sequential``) among them, and the children
    of a child that holds a container (``transformer.h.3``); an element is never opened."""
    units: list[str] = []

    def holds_container(m: nn.Module) -> bool:
        return any(isinstance(d, _CONTAINERS) for d in m.modules())

    def elements(c: nn.Module, prefix: str) -> None:
        for name, e in c.named_children():
            if isinstance(e, _CONTAINERS):
                elements(e, f"{prefix}{name}.")
            else:
                units.append(f"{prefix}{name}")

    def walk(m: nn.Module, prefix: str) -> None:
        for name, child in m.named_children():
            path = f"{prefix}{name}"
            if isinstance(child, _CONTAINERS):
                elements(child, path + ".")
            elif holds_container(child):
                walk(child, path + ".")
            else:
                units.append(path)

    walk(module, "")
    return units


def _unit_of(target: str, units: Iterable[str]) -> str | None:
    """The unit holding submodule ``target`` (the longest matching path)."""
    best = None
    for u in units:
        if (target == u or target.startswith(u + ".")) and (best is None or len(u) > len(best)):
            best = u
    return best


class _Tracer(fx.Tracer):
    """Traces with the units as leaves; a torch builtin holding a unit is opened."""

    def __init__(self, leaves: set[str], inside: set[str]) -> None:
        super().__init__()
        self.leaves = leaves
        self.inside = inside  # paths above a leaf: never leaves themselves

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        if qualname in self.leaves:
            return True
        return qualname not in self.inside and super().is_leaf_module(m, qualname)


# --------------------------------------------------------------------------- capture


def capture(module: nn.Module, split_points: Sequence[str] = ()) -> nn.Sequential:
    """``module`` as an ``nn.Sequential`` of blocks (the carry contract above); raises
    :class:`CaptureError` naming the failing operation where it cannot be captured."""
    exported = _hugging_face(module)
    params = {} if exported else _parameters(module)
    points = list(split_points)
    if points:
        if len(set(points)) != len(points):
            raise CaptureError(f"split_points names a submodule twice: {points}")
        for p in points:
            try:
                module.get_submodule(p)
            except AttributeError:
                raise CaptureError(f"split_points: the model has no submodule {p!r}") from None
            if not p:
                raise CaptureError("split_points: '' is the whole model, not a submodule")
        units = natural_units(module)
        leaves = {u for u in units if not any(p.startswith(u + ".") for p in points)} | set(points)
        starts_at = points
    else:
        units = natural_units(module)
        leaves = set(units)
        starts_at = units
    if exported:
        return _capture_exported(module, starts_at, bool(points))
    inside = {
        ".".join(path.split(".")[:i]) for path in leaves for i in range(1, path.count(".") + 1)
    }
    concrete = {
        n: p.default
        for n, p in params.items()
        if p.default is not None and p.default is not p.empty
    }
    for n, value in concrete.items():
        if not _plain(value):
            raise CaptureError(
                f"forward's parameter {n!r} defaults to a {type(value).__name__}; a captured "
                "model's defaults are None or plain values (bool, int, float, str)"
            )
    tracer = _Tracer(leaves, inside)
    try:
        graph = tracer.trace(module, concrete_args=concrete or None)
    except Exception as exc:  # any trace failure is the model's: say where it happened
        raise CaptureError(f"torch.fx cannot trace it{_where(exc)}: {_short(exc)}") from None
    try:
        root = fx.GraphModule(tracer.root, graph)
    except Exception as exc:  # the trace holds what fx cannot turn back into code
        raise CaptureError(f"torch.fx cannot rebuild the traced code: {_short(exc)}") from None
    blocks, starts, carries = _cut(
        root.graph, starts_at, bool(points), list(params), set(concrete), type(module).__name__
    )
    return _sequential(module, root, blocks, starts, carries)


def _capture_exported(module: nn.Module, starts_at: Sequence[str], split: bool) -> nn.Sequential:
    """The :mod:`torch.export` route (:mod:`hetpipe.capture_export`): a Hugging Face model
    exported with an example batch made from its configuration, cut at the same units.

    Exporting takes seconds and a process builds the same model several times (the plan,
    each stage, on the meta device): the cut is kept per model class, configuration and
    units, and a new build's blocks hold that build's own tensors."""
    key = capture_export.cache_key(module, starts_at, split)
    found = _EXPORTED.get(key) if key is not None else None
    if found is None:
        try:
            root, names, constant = capture_export.export_graph(module)
        except capture_export.ExportFailure as exc:
            raise CaptureError(str(exc)) from None
        blocks, starts, carries = _cut(
            root.graph,
            starts_at,
            split,
            names,
            constant,
            type(module).__name__,
            path_of=capture_export.unit_of_node,
        )
        for _, g in blocks:
            capture_export.place_on_inputs(g)
        found = (root, blocks, starts, carries)
        graphs = [g for _, g in blocks]
        kept = (capture_export.rebind(root, module, graphs, own=False), blocks, starts, carries)
        if key is not None:
            while len(_EXPORTED) >= 8:
                _EXPORTED.pop(next(iter(_EXPORTED)))
            _EXPORTED[key] = kept
    root, blocks, starts, carries = found
    root = capture_export.rebind(root, module, [g for _, g in blocks])
    copies = [(i, capture_export.copy_graph(g)) for i, g in blocks]
    seq = _sequential(module, root, copies, starts, carries)
    capture_export.own_constants(seq, module)
    return seq


# exported cuts by capture_export.cache_key: (root, blocks, starts, carries)
_EXPORTED: dict[Any, tuple[nn.Module, list[tuple[int, fx.Graph]], tuple, tuple]] = {}


def _sequential(
    module: nn.Module,
    root: nn.Module,
    blocks: list[tuple[int, fx.Graph]],
    starts: tuple[str, ...],
    carries: tuple[tuple[str, ...], ...],
) -> nn.Sequential:
    """The blocks as one ``nn.Sequential``, its :class:`Capture` beside it."""
    seq = nn.Sequential(*(fx.GraphModule(root, g, class_name=f"Block{i}") for i, g in blocks))
    keys, user_keys = _key_maps(seq, module)
    seq.__dict__["_hetpipe_capture"] = Capture(module, starts, carries, keys, user_keys)
    return seq


def _called_module(node: fx.Node) -> str | None:
    """The submodule a traced ``node`` calls (a unit, or inside one), else ``None``."""
    return str(node.target) if node.op == "call_module" else None


def _hugging_face(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers ``PreTrainedModel`` (told by its classes' modules,
    so that transformers is never imported here)."""
    return any(
        c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers.")
        for c in type(module).__mro__
    )


def _plain(value: Any) -> bool:
    """Whether ``value`` can be written into a block's code as it is."""
    if isinstance(value, (tuple, list)):
        return all(_plain(v) for v in value)
    return isinstance(value, (bool, int, float, str))


def _parameters(module: nn.Module) -> dict[str, inspect.Parameter]:
    """forward's parameters by name; ``*args``/``**kwargs`` are refused."""
    params = dict(inspect.signature(module.forward).parameters)
    for name, p in params.items():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise CaptureError(f"forward takes {'*' if p.kind == p.VAR_POSITIONAL else '**'}{name}")
    return params


def _where(exc: BaseException) -> str:
    """`` at file:line (code)``: the innermost frame of the model's own code in ``exc``."""
    tb, found = exc.__traceback__, None
    while tb is not None:
        path = tb.tb_frame.f_code.co_filename
        if not path.startswith(_TORCH_DIR) and not path.startswith(os.path.dirname(__file__)):
            found = (path, tb.tb_lineno)
        tb = tb.tb_next
    if found is None:
        return ""
    code = linecache.getline(*found).strip()
    return f" at {os.path.basename(found[0])}:{found[1]} ({code})" if code else ""


def _short(exc: BaseException) -> str:
    """The first line of ``exc``'s message, with its type."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".strip()


def _inputs(node: fx.Node) -> list[fx.Node]:
    """The nodes ``node`` reads, in argument order."""
    found: list[fx.Node] = []
    fx.map_arg((node.args, node.kwargs), lambda a: found.append(a) or a)
    return found


def _recomputable(node: fx.Node, known: dict[fx.Node, bool]) -> bool:
    """Whether ``node`` is a non-tensor value, a parameter or a constant: computed again in
    each block that uses it, never carried."""
    if node.op == "get_attr":
        return True
    if node.op in ("placeholder", "output", "call_module"):
        return False
    target = node.target
    if node.op == "call_method" and target in _META_METHODS:
        return True
    if str(target).startswith("aten.sym_"):  # an exported graph's size of a tensor
        return True
    if target is builtins.getattr and node.args[1] in _META_ATTRS:
        return True
    name = getattr(target, "__name__", str(target))
    if any(r in name for r in _RANDOM):
        return False
    return all(known[a] for a in _inputs(node))


def _cut(
    graph: fx.Graph,
    starts_at: Sequence[str],
    split: bool,
    names: list[str],
    concrete: set[str],
    model: str,
    path_of: Callable[[fx.Node], str | None] = _called_module,
) -> tuple[list[tuple[int, fx.Graph]], tuple[str, ...], tuple[tuple[str, ...], ...]]:
    """Cut the traced ``graph`` into block graphs: (index, graph) each, the submodule each
    block starts at, and the names of the values entering each block.

    A block starts at the first operation run in each of ``starts_at`` (``path_of`` says
    which submodule a node runs in); with ``split`` (the user's split points) also the first
    one, where anything was computed before it."""
    nodes = list(graph.nodes)
    recompute: dict[fx.Node, bool] = {}
    for n in nodes:
        recompute[n] = _recomputable(n, recompute)
    tensor: dict[fx.Node, bool] = {}  # of the recomputed: whether it is a tensor
    for n in nodes:
        tensor[n] = recompute[n] and _tensor_valued(n, tensor)
    at: dict[fx.Node, int] = {}  # each node's block in program order
    home: dict[fx.Node, int] = {}  # the block that computes a node that is not recomputed
    starts: list[str] = [""]
    seen: set[str] = set()
    block = 0
    for n in nodes:
        path = None if recompute[n] else path_of(n)
        if path is not None:
            unit = _unit_of(path, starts_at)
            if unit is not None and unit not in seen:
                seen.add(unit)
                ran = any(
                    at[m] == block and not recompute[m] for m in home if m.op != "placeholder"
                )
                if len(seen) > 1 or (split and ran):
                    block += 1
                    starts.append(unit)
                else:
                    starts[0] = unit
        at[n] = block
        if n.op == "placeholder":
            home[n] = 0
        elif n.target is operator.getitem and _tuple_of_unit(n.args[0]):
            home[n] = home[n.args[0]]  # an element of a unit's tuple stays with the unit
        else:
            home[n] = block
    missing = [p for p in starts_at if p not in seen]
    if split and missing:
        raise CaptureError(f"split_points: forward never calls {', '.join(map(repr, missing))}")
    n_blocks = block + 1
    # a size read again in a block from a tensor entering it (an exported graph's symbolic
    # sizes): (size, block) -> (tensor, dim)
    resized: dict[tuple[fx.Node, int], tuple[fx.Node, int]] = {}
    while True:  # a tensor that cannot be computed again where it is used is carried there
        again, carry_in, failed = _needs(nodes, recompute, home, n_blocks, resized)
        if failed is None:
            break
        root, via, b, reader = failed
        found = _same_size(reader, carry_in[b])
        if found is not None:
            resized[(reader, b)] = found
            continue
        if not tensor[via]:
            raise CaptureError(
                f"{via.name} ({_text(via)}), used in the block starting at "
                f"{starts[b] or 'the inputs'}, is computed from {root.name}, a tensor that "
                "does not reach that block; compute it from a tensor there"
            )
        recompute[via] = False
        home[via] = at[via]

    blocks: list[tuple[int, fx.Graph]] = []
    for b in range(n_blocks):
        g = fx.Graph()
        env: dict[fx.Node, Any] = {}
        if b == 0:
            batch = g.placeholder("batch")
            placeholders = [n for n in nodes if n.op == "placeholder"]
            given = tuple(names[i] for i, _ in enumerate(placeholders) if names[i] not in concrete)
            required = tuple(n for n in given if n in _required_of(graph, names))
            bound = g.call_function(bind_inputs, (batch, given, required, model))
            j = 0
            for i, ph in enumerate(placeholders):
                if names[i] in concrete:
                    env[ph] = ph.args[0] if ph.args else None
                else:
                    env[ph] = g.call_function(operator.getitem, (bound, j))
                    j += 1
        else:
            carry = g.placeholder("carry")
            ins = carry_in[b]
            for i, t in enumerate(ins):
                env[t] = carry if len(ins) == 1 else g.call_function(operator.getitem, (carry, i))
            for (size, at_b), (t, dim) in resized.items():
                if at_b == b:
                    env[size] = g.call_function(size.target, (env[t], dim))
        for n in nodes:
            if n.op in ("placeholder", "output"):
                continue
            if n in again[b] or (not recompute[n] and home[n] == b):
                env[n] = g.node_copy(n, env.__getitem__)
        if b == n_blocks - 1:
            out = next(n for n in nodes if n.op == "output")
            g.output(fx.map_arg(out.args[0], env.__getitem__))
        else:
            outs = [env[t] for t in carry_in[b + 1]]
            g.output(outs[0] if len(outs) == 1 else tuple(outs))
        g.lint()
        blocks.append((b, g))
    carries = [tuple(n for n in names if n not in concrete)]
    carries += [tuple(t.name for t in carry_in[b]) for b in range(1, n_blocks)]
    return blocks, tuple(starts), tuple(carries)


def _needs(
    nodes: list[fx.Node],
    recompute: dict[fx.Node, bool],
    home: dict[fx.Node, int],
    n_blocks: int,
    resized: Mapping[tuple[fx.Node, int], tuple[fx.Node, int]],
) -> tuple[list[set[fx.Node]], list[list[fx.Node]], tuple[fx.Node, fx.Node, int, fx.Node] | None]:
    """The values each block computes again, the tensors entering each block (program
    order), and the first recomputed value that cannot be computed where it is used:
    (the tensor it needs, the outermost recomputed value, the block, the recomputed value
    reading that tensor), or ``None``. ``resized``: sizes a block reads from another tensor."""
    last_use: dict[fx.Node, int] = {}
    again: list[set[fx.Node]] = [set() for _ in range(n_blocks)]
    pending: list[tuple[fx.Node, fx.Node, int, fx.Node]] = []

    def need(a: fx.Node, b: int, via: fx.Node | None, reader: fx.Node | None = None) -> None:
        if recompute[a] and (a, b) in resized:
            need(resized[(a, b)][0], b, None)
        elif recompute[a]:
            if a not in again[b]:
                again[b].add(a)
                for x in _inputs(a):
                    need(x, b, via or a, a)
        elif via is not None and reader is not None:
            pending.append((a, via, b, reader))
        elif home[a] < b:
            last_use[a] = max(last_use.get(a, b), b)

    for n in nodes:
        if n.op == "placeholder" or recompute[n]:
            continue
        b = home[n] if n.op != "output" else n_blocks - 1
        for a in _inputs(n):
            need(a, b, None)
    carry_in = [
        [t for t in nodes if t in last_use and home[t] < b <= last_use[t]] for b in range(n_blocks)
    ]
    for a, via, b, reader in pending:
        if home[a] != b and a not in carry_in[b]:
            return again, carry_in, (a, via, b, reader)
    return again, carry_in, None


def _tuple_of_unit(node: fx.Node) -> bool:
    """Whether ``node`` gives a tuple that is one unit's result: a traced submodule call, or
    an exported operation with several results."""
    if not isinstance(node, fx.Node):
        return False
    return node.op == "call_module" or (
        node.op == "call_function" and isinstance(node.meta.get("val"), (tuple, list))
    )


def _same_size(reader: fx.Node, entering: Sequence[fx.Node]) -> tuple[fx.Node, int] | None:
    """Where ``reader`` is the symbolic size of a tensor that does not reach a block (an
    exported graph's ``aten.sym_size``): a tensor entering that block, and its dimension, of
    the same size; else ``None``."""
    if not str(reader.target).startswith("aten.sym_size"):
        return None
    size = reader.meta.get("val")
    if not isinstance(size, torch.SymInt):
        return None
    for t in entering:
        value = t.meta.get("val")
        if isinstance(value, Tensor):
            for dim, s in enumerate(value.shape):
                if isinstance(s, torch.SymInt) and str(s) == str(size):
                    return t, dim
    return None


def _tensor_valued(node: fx.Node, tensor: dict[fx.Node, bool]) -> bool:
    """Whether recomputed ``node`` is a tensor (a parameter, a torch function of shapes, or
    an operation on such a tensor), not a shape, a size or a dtype."""
    if "val" in node.meta:  # an exported graph says what each value is
        return isinstance(node.meta["val"], Tensor)
    if node.op == "get_attr":
        return True
    if node.op == "call_method":
        return (
            node.target not in _META_METHODS and bool(node.args) and tensor.get(node.args[0], False)
        )
    if node.op != "call_function" or node.target is builtins.getattr:
        return False
    module = getattr(node.target, "__module__", "") or ""
    if module == "torch" or module.startswith("torch."):
        return True
    return any(tensor.get(a, False) for a in _inputs(node))


def _required_of(graph: fx.Graph, names: list[str]) -> set[str]:
    """forward's parameters without a default (their placeholders carry none)."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    return {names[i] for i, ph in enumerate(placeholders) if not ph.args}


def _text(node: fx.Node) -> str:
    """A short description of ``node``'s operation."""
    target = node.target
    name = target if isinstance(target, str) else getattr(target, "__name__", str(target))
    return f"{node.op} {name}"


def bind_inputs(batch: Any, names: tuple[str, ...], required: tuple[str, ...], model: str) -> tuple:
    """The first block's inputs in forward's order, from a Tensor, a tuple or a Mapping by
    parameter name; a parameter left out takes ``None`` (its default). ``model``: the
    module's class, for the errors."""
    if isinstance(batch, Mapping):
        # a batch's labels are its target too: an input only where forward takes them
        unknown = [k for k in batch if k not in names and k != "labels"]
        if unknown:
            raise CaptureError(
                f"{model}: the batch has {', '.join(map(repr, unknown))}, which forward does "
                f"not take as an input ({', '.join(names)})"
            )
        absent = [n for n in required if n not in batch]
        if absent:
            raise CaptureError(f"{model}: the batch lacks input {', '.join(map(repr, absent))}")
        return tuple(batch.get(n) for n in names)
    values = (batch,) if isinstance(batch, Tensor) else batch
    if not isinstance(values, (tuple, list)) or not len(required) <= len(values) <= len(names):
        raise CaptureError(
            f"{model}: forward takes {len(required)}..{len(names)} inputs ({', '.join(names)}), "
            f"got {type(batch).__name__}"
            + (f" of {len(values)}" if isinstance(batch, (tuple, list)) else "")
        )
    return tuple(values) + (None,) * (len(names) - len(values))


def _key_maps(seq: nn.Sequential, user: nn.Module) -> tuple[dict[str, str], dict[str, str | None]]:
    """The blocks' state keys with the user's key of the same tensor, and the other way."""
    ours = seq.state_dict(keep_vars=True)
    theirs = user.state_dict(keep_vars=True)
    by_id: dict[int, list[str]] = {}
    for k, t in theirs.items():
        by_id.setdefault(id(t), []).append(k)
    keys: dict[str, str] = {}
    first: dict[int, str] = {}
    for k, t in ours.items():
        names = by_id.get(id(t))
        if not names:
            continue  # a constant the trace made: the blocks' own, never exported
        plain = k.partition(".")[2]
        keys[k] = plain if plain in names else names[0]
        first.setdefault(id(t), k)
    user_keys = {k: first.get(id(t)) for k, t in theirs.items()}
    return keys, user_keys
