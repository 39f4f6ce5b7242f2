"""safetorch's own frames are not compiled by ``torch.compile``.

Under ``torch.compile`` every Python frame that starts while a compiled function runs is offered to dynamo: the
code after a graph break runs eagerly, and what it calls — ``loss.backward()`` reaching safetorch's backward patch,
an optimizer's step hook, an eval-mode model's guard — would be compiled as user code, each a graph of its own (8
graphs instead of 4 over the tutorial's compiled training step). Those frames are marked here, through torch's C
extension, to run as plain Python (``set_code_exec_strategy``: skip this frame, compile what it calls as usual),
as dynamo marks its own; the program's functions that they call (a forward, a closure) are compiled as without
safetorch. When dynamo *inlines* a patch into a graph (a compiled model calling ``F.dropout``), the patch sees
``torch.compiler.is_compiling()`` and calls torch's function at once, so the graph is torch's.

Nothing of dynamo is imported: ``torch._C._dynamo`` is part of torch's C extension, loaded with torch. A torch that
has neither entry point (older than 2.1's ``skip_code``) skips nothing.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable, Iterator
from types import CodeType, FunctionType
from typing import Any

_done: set[int] = set()

#: Standard modules safetorch's checks run their own code through (ST021 reads a backward's caller with ``dis``, whose
#: generators dynamo would count as frames it cannot trace): their frames run as plain Python too.
_READ_WITH = frozenset({"dis"})


def _skipper() -> Callable[[CodeType], None] | None:
    frames = getattr(getattr(getattr(sys.modules.get("torch._C"), "_dynamo", None), "eval_frame", None), "__dict__",
                     {})
    strategy, action = frames.get("_FrameExecStrategy"), frames.get("_FrameAction")
    setter = frames.get("set_code_exec_strategy")
    if strategy is not None and action is not None and setter is not None:  # torch 2.7+
        skip = strategy(action.SKIP, action.DEFAULT)  # this frame runs as plain Python; what it calls, as usual
        return lambda code: setter(code, skip)
    return frames.get("skip_code")  # type: ignore[no-any-return]  # torch 2.1-2.6


def _codes(code: CodeType) -> Iterator[CodeType]:
    """A code object and those of the functions, lambdas and comprehensions defined in it."""
    yield code
    for const in code.co_consts:
        if isinstance(const, CodeType):
            yield from _codes(const)


def _functions(value: Any) -> Iterator[FunctionType]:
    if isinstance(value, FunctionType):
        yield value
    elif isinstance(value, (staticmethod, classmethod)):
        yield from _functions(value.__func__)
    elif isinstance(value, property):
        for accessor in (value.fget, value.fset, value.fdel):
            yield from _functions(accessor)


def skip_own_frames() -> None:
    """Mark the code of every function and method of safetorch's loaded modules as never compiled at the top
    (once per code object; a module loaded later is marked at the next install)."""
    skip = _skipper()
    if skip is None:
        return
    for name, module in list(sys.modules.items()):
        if not (name in _READ_WITH or name == "safetorch" or name.startswith("safetorch.")) or id(module) in _done \
                or not isinstance(module, types.ModuleType):  # None: an import that was stopped
            continue
        _done.add(id(module))
        for value in list(vars(module).values()):
            if getattr(value, "__module__", None) != name:
                continue
            members = vars(value).values() if isinstance(value, type) else (value,)
            for member in list(members):
                for function in _functions(member):
                    for code in _codes(function.__code__):
                        skip(code)
