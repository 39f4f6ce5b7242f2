"""The one account of autograd graphs kept alive: who holds them, how much their saved tensors weigh, whether a
backward has consumed them. ST004 asks it when it decides, the out-of-memory note when memory has run out.

Design rules:
- Nothing here runs per step: it walks graphs and frames only when asked, at a looked-at optimizer step, at a
  decision, at exit or for a crash note.
- A graph's weight is the bytes of the tensors its nodes saved for backward (``node._saved_*``, a custom Function's
  ``saved_tensors``), each storage counted once, less the parameters' (a parameter lives anyway). A backward frees
  them: a consumed graph weighs nothing, and keeps only its nodes.
- A *marker* put in a node's ``metadata`` lives exactly as long as the node (the dict is the node's): a weak
  reference to it says whether that graph is still alive, and a pre-hook on the node says whether a backward ran
  through it — with no reference to the graph, which would keep it alive.
- Holders are found by name, from frames: their locals (a module frame's are its globals) and one attribute level
  below ``self``; a container counts its items that carry a graph, and an item may be a small tuple or dict of them
  (``outputs.append({"loss": loss})``).
"""

from __future__ import annotations

import ast
import gc
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import torch

from . import _visible
from ._callsite import frame_locals, normalized

__all__ = ["Account", "Holder", "Marker", "account", "fixed", "graph_items", "holders", "human", "mark", "marker_of",
           "statement_of", "sums"]

TAG = "safetorch"
#: Nodes walked per account at most: a long-kept graph has millions; the bytes of its first ones tell the story.
NODES = 200_000
#: Items of one container looked at for graphs.
ITEMS = 100_000
_SAVED_SUFFIXES = ("_sym_sizes", "_sym_strides", "_sym_storage_offset", "_sym_argsize_0")
_saved_names: dict[type, tuple[str, ...]] = {}


class Marker:
    """Put in a node's metadata: alive while the node is, ``consumed`` once a backward ran through it."""

    __slots__ = ("__weakref__", "consumed", "site")

    def __init__(self, site: Any = None) -> None:
        self.consumed = False
        self.site = site

    def __call__(self, grad_outputs: Any) -> None:  # the node's pre-hook
        self.consumed = True


def mark(tensor: torch.Tensor, site: Any = None) -> Marker | None:
    """Mark the node that made ``tensor`` (None for a tensor without one). A node marked already keeps its marker."""
    node = tensor.grad_fn
    if node is None:
        return None
    known = marker_of(node)
    if known is not None:
        return known
    marker = Marker(site)
    node.metadata[TAG] = marker
    node.register_prehook(marker)
    return marker


def marker_of(node: Any) -> Marker | None:
    try:
        found = node.metadata.get(TAG)
    except Exception:  # a node type without metadata
        return None
    return found if isinstance(found, Marker) else None


def _names_of(node: Any) -> tuple[str, ...]:
    kind = type(node)
    names = _saved_names.get(kind)
    if names is None:
        names = _saved_names[kind] = tuple(a for a in dir(node) if a.startswith("_saved_")
                                           and not a.endswith(_SAVED_SUFFIXES))
    return names


def _saved(node: Any) -> tuple[list[torch.Tensor], bool]:
    """The tensors a node saved for backward, and whether a backward released them."""
    out: list[torch.Tensor] = []
    released = False
    names = _names_of(node)
    for name in names:
        try:
            value = getattr(node, name)
        except RuntimeError:  # "Trying to backward through the graph a second time": released
            released = True
            continue
        except Exception:
            continue
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif isinstance(value, (list, tuple)):
            out.extend(v for v in value if isinstance(v, torch.Tensor))
    if not names and hasattr(node, "saved_tensors"):  # a custom autograd.Function's node
        try:
            out.extend(t for t in node.saved_tensors if isinstance(t, torch.Tensor))
        except RuntimeError:
            released = True
        except Exception:
            pass
    return out, released


def _storage(t: torch.Tensor) -> tuple[tuple[str, int], int] | None:
    try:
        storage = t.untyped_storage()
        return (str(t.device), storage.data_ptr()), storage.nbytes()
    except Exception:  # a tensor without storage (sparse, a subclass, meta)
        return None


@dataclass
class Account:
    """What a set of graphs holds: the nodes walked, the saved bytes (not the parameters'), whether saved tensors
    were found released (a backward consumed them), and the markers met on the way."""

    nodes: int = 0
    saved: dict[tuple[str, int], int] = field(default_factory=dict)
    parameters: set[tuple[str, int]] = field(default_factory=set)
    released: int = 0
    kept: int = 0
    markers: list[Marker] = field(default_factory=list)
    visited: dict[int, Any] = field(default_factory=dict)
    children: set[int] = field(default_factory=set)

    @property
    def bytes(self) -> int:
        return sum(n for key, n in self.saved.items() if key not in self.parameters)


def account(tensors: Iterable[torch.Tensor], into: Account | None = None, limit: int = NODES) -> Account:
    """Walk the graphs that made ``tensors`` (once per node, also across calls sharing ``into``)."""
    acc = into if into is not None else Account()
    stack = [t.grad_fn for t in tensors if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    while stack and len(acc.visited) < limit:
        node = stack.pop()
        if node is None or id(node) in acc.visited:
            continue
        acc.visited[id(node)] = node  # held until the walk ends: ids stay unique
        acc.nodes += 1
        variable = getattr(node, "variable", None)  # AccumulateGrad: a parameter
        if isinstance(variable, torch.Tensor):
            found = _storage(variable)
            if found is not None:
                acc.parameters.add(found[0])
            continue
        marker = marker_of(node)
        if marker is not None:
            acc.markers.append(marker)
        saved, released = _saved(node)
        acc.released += released
        acc.kept += bool(saved)
        for t in saved:
            found = _storage(t)
            if found is not None:
                acc.saved[found[0]] = found[1]
        for child, _ in node.next_functions:
            if child is not None:
                acc.children.add(id(child))
                stack.append(child)
    return acc


def carries(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.grad_fn is not None


def graph_items(value: Any, limit: int = ITEMS) -> Iterator[tuple[Any, torch.Tensor]]:
    """(key, tensor) for the items of a list, tuple, deque or dict that carry a graph; an item may itself be a small
    tuple, list or dict of tensors (``outputs.append({"loss": loss, "logits": out})``)."""
    if isinstance(value, dict):
        pairs: Iterable[tuple[Any, Any]] = list(value.items())[:limit]
    elif isinstance(value, (list, tuple, deque)):
        pairs = enumerate(list(value)[:limit])
    else:
        return
    for key, item in pairs:
        if carries(item):
            yield key, item
        elif isinstance(item, (tuple, list)) and len(item) <= 8:
            yield from ((key, t) for t in item if carries(t))
        elif isinstance(item, dict) and len(item) <= 16:
            yield from ((key, t) for t in item.values() if carries(t))


def first_graph_item(value: Any) -> tuple[Any, torch.Tensor] | None:
    return next(graph_items(value), None)


@dataclass
class Holder:
    """A name that holds graphs: ``losses`` (list, 240 items), ``total`` (a tensor), in the frame that sees it."""

    name: str
    value: Any
    frame: FrameType
    tensors: list[torch.Tensor]
    graphs: int  # its items that carry a graph (an item may carry several tensors: `(out, loss)`)

    @property
    def kind(self) -> str:
        return type(self.value).__name__

    def describe(self) -> str:
        if isinstance(self.value, torch.Tensor):
            added = sums(self.value)
            return f"`{self.name}` (a tensor, the sum of {added} graphs)" if added > 1 else f"`{self.name}` (a tensor)"
        return f"`{self.name}` ({self.kind}, {len(self.value)} items)"


_SKIP = (type, type(gc), type(len), type(lambda: 0))


def _named(frame: FrameType) -> Iterator[tuple[str, Any]]:
    """A frame's names and their values, and one attribute level below ``self`` (``self.losses``)."""
    for name, value in list(frame_locals(frame).items()):
        if name.startswith("__") or isinstance(value, _SKIP):
            continue
        yield name, value
        if name == "self":  # its attributes that hold graphs, read without building its __dict__ (`_visible`)
            try:
                held = _visible.attributes(value, _holds, 256)
            except Exception:  # a hostile property named __dict__
                held = []
            for attr, sub in held:
                yield f"self.{attr}", sub


def _holds(value: Any) -> bool:
    try:
        return _held(value) is not None
    except Exception:
        return False


_PROBE = 16  # items at each end of a container looked at before all of them are


def _probe(value: list[Any] | tuple[Any, ...] | deque[Any] | dict[Any, Any]) -> bool:
    """Whether a container may hold graphs: one of its first or last few items carries one (a list of losses does
    at its end; a dataset of plain tensors at neither), so that a long container without is not read through."""
    if len(value) <= 2 * _PROBE:
        return True
    items = list(value.values()) if isinstance(value, dict) else value
    ends = [items[i] for i in (*range(_PROBE), *range(-_PROBE, 0))]
    return first_graph_item(ends) is not None


def holders(frames: Iterable[FrameType]) -> list[Holder]:
    """The names in ``frames`` that hold tensors carrying a graph: a tensor, or a container of them. A value seen
    under two names (a frame's and its caller's) is given once, under the first. A value that fails to be read (a
    container subclass whose methods raise) is passed over: the program's objects are only looked at."""
    found: list[Holder] = []
    seen: set[int] = set()
    for frame in frames:
        for name, value in _named(frame):
            if id(value) in seen:
                continue
            try:
                held = _held(value)
            except Exception:
                continue
            if held is not None:
                seen.add(id(value))
                found.append(Holder(name, value, frame, *held))
    return found


def _held(value: Any) -> tuple[list[torch.Tensor], int] | None:
    """The tensors carrying a graph that ``value`` holds, and how many of its items carry one; None for none."""
    if carries(value):
        return [value], 1
    if isinstance(value, dict) and "__builtins__" in value:
        return None  # a module's namespace (runpy's run_globals): its names are looked at as the module's
    if isinstance(value, (list, tuple, deque, dict)) and _probe(value):
        pairs = list(graph_items(value))
        if pairs:
            return [t for _, t in pairs], len({key for key, _ in pairs})
    return None


def sums(t: torch.Tensor, limit: int = 1_000_000) -> int:
    """How many additions made ``t`` (``total += loss`` over and over: a chain of add nodes)."""
    node, n = t.grad_fn, 0
    while node is not None and n < limit and node.name().startswith("AddBackward"):
        n += 1
        node = node.next_functions[0][0] if node.next_functions else None
    return n


def human(n: float) -> str:
    """Bytes as people read them: 1.2 GB, 340 MB, 12 kB (decimal units, as ``ls -h --si`` and GPU tools show)."""
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def graph_tensors() -> list[torch.Tensor]:
    """Every live tensor that carries a graph, from the garbage collector's list: for a crash note only."""
    out = []
    for obj in gc.get_objects():
        try:
            if issubclass(type(obj), torch.Tensor):
                if obj.grad_fn is not None:
                    out.append(obj)
        except Exception:
            continue
    return out


def statement_of(line: str, name: str) -> str:
    """The statement of a source line that fills the holder ``name`` (a line may hold several, ``a; b``), on one line
    as a message quotes it."""
    text = line.strip()
    try:
        body = ast.parse(text, mode="exec").body
    except SyntaxError:
        return normalized(text)
    for node in body:
        segment = ast.get_source_segment(text, node) or ""
        if name in segment:
            return normalized(segment)
    return normalized(text)


def addend(node: ast.Assign, value: ast.BinOp) -> ast.expr:
    """Of ``target = a + b``, the side that does not read the target (the sum itself when both or neither do)."""
    target = ast.unparse(node.targets[0])
    left, right = (target in {ast.unparse(n) for n in ast.walk(side)} for side in (value.left, value.right))
    if left != right:
        return value.right if left else value.left
    return value


def fixed(statement: str, suffix: str) -> str:
    """The line with ``suffix`` (``.item()``, ``.detach()``) on the value it stores: ``losses.append(loss.item())``,
    ``total += loss.detach()``, ``total = total + loss.item()``, ``d[k] = loss.item()``. A line that is none of these
    is named with a generic fix."""
    try:
        node: Any = ast.parse(statement, mode="exec").body[0]
    except (SyntaxError, IndexError):
        node = None
    value = None
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) and node.value.args:
        value = node.value.args[-1]
    elif isinstance(node, (ast.AugAssign, ast.Assign)):
        value = node.value
        if isinstance(node, ast.Assign) and isinstance(value, ast.BinOp) and isinstance(value.op, ast.Add):
            value = addend(node, value)  # ``total = total + loss``: the value added, not the sum
    if not isinstance(value, (ast.Name, ast.Attribute, ast.Call, ast.Subscript, ast.BinOp, ast.UnaryOp)):
        return f"store the value{suffix} (a number, or a tensor without a graph)"
    start, end = value.col_offset, value.end_col_offset
    if value.lineno != 1 or value.end_lineno != 1 or end is None:
        return f"store the value{suffix} (a number, or a tensor without a graph)"
    text = statement.encode()
    segment = text[start:end].decode()
    if not isinstance(value, (ast.Name, ast.Attribute, ast.Call, ast.Subscript)):
        segment = f"({segment})"
    return (text[:start].decode() + segment + suffix + text[end:].decode()).strip()
