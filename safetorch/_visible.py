"""The modules a frame can see by name: what a finding about "a model" names (ST020's loss network) and where a rule
looks for the models an optimizer trains (ST019).

Design rules: no ``gc`` walk and nothing recursive: a frame's locals, then its globals, and one attribute level below
an object they hold (``self.vgg``, ``trainer.model``), bounded by `LIMIT` names; asked at a looked-at step or for a
finding, never per call.
"""

from __future__ import annotations

from types import BuiltinFunctionType, FrameType, FunctionType, MethodType, ModuleType

import torch

from ._callsite import frame_locals

__all__ = ["LIMIT", "frame_locals", "modules"]

LIMIT = 256  # names looked at, and modules returned, at most
_ATTRIBUTES = 64  # attributes looked at per object
_NOT_HOLDERS = (type, ModuleType, FunctionType, BuiltinFunctionType, MethodType, torch.Tensor)
def modules(frame: FrameType, limit: int = LIMIT) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) for the modules the frame sees: its locals, then its globals, then those one attribute below a
    local or global object that is not a module itself, in that order (a name may be given twice)."""
    found: list[tuple[str, torch.nn.Module]] = []
    local = frame_locals(frame)
    scopes = [local] if local is frame.f_globals else [local, frame.f_globals]
    looked = 0
    for scope in scopes:
        for name, value in list(scope.items()):
            looked += 1
            if looked > limit or len(found) >= limit:
                return found
            if isinstance(value, torch.nn.Module):
                found.append((name, value))
            elif not isinstance(value, _NOT_HOLDERS):
                attributes = getattr(value, "__dict__", None)
                if isinstance(attributes, dict):
                    found.extend((f"{name}.{attr}", sub) for attr, sub in list(attributes.items())[:_ATTRIBUTES]
                                 if isinstance(sub, torch.nn.Module))
    return found
