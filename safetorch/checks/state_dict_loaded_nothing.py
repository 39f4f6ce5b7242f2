"""ST014: ``load_state_dict(sd, strict=False)`` that loaded (almost) nothing, so the model runs with its random
initial weights. Nearly always a key prefix: ``module.`` (saved from DataParallel/DDP), ``_orig_mod.`` (saved from
``torch.compile``), ``model.`` (saved from a wrapper, a Lightning module).

``Module.load_state_dict`` is wrapped; its result is looked at only for ``strict=False`` (``strict=True`` raises on
any mismatch itself). Reported when at most 10% of the model's keys were loaded *and* at most 10% of the given keys
were used: a backbone loaded into a bigger model (most of the given keys used), a checkpoint with extra heads loaded
into a smaller model (most of the model's keys loaded) and an adapter-only state dict stay silent. The message names
the prefix that would make the keys match, when one does.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

import torch.nn as nn

from .._exceptions import SafetorchWarning
from .._patch import Registry
from .._report import internal_error, report, user_frame
from .._rule import Rule

CODE = "ST014"
_FRACTION = 0.1


class StateDictLoadedNothingWarning(SafetorchWarning):
    """ST014: ``load_state_dict(strict=False)`` matched (almost) no key: the model keeps its random weights."""

    code = "ST014"


RULE = Rule("ST014", "state-dict-loaded-nothing", StateDictLoadedNothingWarning,
            "load_state_dict(strict=False) that loaded (almost) nothing: a key prefix")


def _prefix(keys: Iterable[str], targets: set[str]) -> tuple[str, int]:
    """The leading ``name.`` of ``keys`` whose removal makes the most of them land in ``targets``."""
    counts: Counter[str] = Counter()
    for key in keys:
        head, dot, rest = key.partition(".")
        while dot:
            if rest in targets:
                counts[key[: len(key) - len(rest)]] += 1
                break
            head, dot, rest = rest.partition(".")
    return counts.most_common(1)[0] if counts else ("", 0)


def _message(given: int, model_keys: int, loaded: int, missing: list[str], unexpected: list[str]) -> str:
    head = (f"{CODE} load_state_dict(..., strict=False) loaded {loaded} of the model's {model_keys} keys from "
            f"{given} given: the model keeps its random initial weights")
    strip, n_strip = _prefix(unexpected, set(missing))
    add, n_add = _prefix(missing, set(unexpected))
    if n_strip >= max(n_add, 1):
        return (f"{head}. The checkpoint's keys start with {strip!r} (e.g. {unexpected[0]!r}), the model's do not: "
                f"load {{k.removeprefix({strip!r}): v for k, v in state_dict.items()}} (or "
                f"torch.nn.modules.utils.consume_prefix_in_state_dict_if_present(state_dict, {strip!r}))")
    if n_add:
        return (f"{head}. The model's keys start with {add!r} (e.g. {missing[0]!r}), the checkpoint's do not: load it "
                f"into the submodule they belong to, or add the prefix: {{{add!r} + k: v for k, v in "
                f"state_dict.items()}}")
    return (f"{head}. No prefix makes them match: is it the checkpoint of another model? The model expects e.g. "
            f"{missing[0]!r}, the checkpoint has e.g. {unexpected[0]!r}")


def _load_state_dict(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    __tracebackhide__ = True  # noqa: F841
    result = wrapped(*args, **kwargs)
    strict = args[1] if len(args) > 1 else kwargs.get("strict", True)
    if strict:
        return result
    try:
        state_dict = args[0] if args else kwargs.get("state_dict")
        missing, unexpected = list(result.missing_keys), list(result.unexpected_keys)
        given = len(state_dict) if isinstance(state_dict, Mapping) else 0
        used = given - len(unexpected)
        model_keys = used + len(missing)
        if given and model_keys and used <= _FRACTION * model_keys and used <= _FRACTION * given:
            frame = user_frame(sys._getframe(1))
            if frame is not None:
                report(CODE, frame, lambda: _message(given, model_keys, used, missing, unexpected))
    except Exception as exc:  # strict-mode findings pass through internal_error
        internal_error(CODE, exc)
    return result


def install(registry: Registry) -> None:
    registry.wrap(nn.Module, "load_state_dict", _load_state_dict, CODE)
