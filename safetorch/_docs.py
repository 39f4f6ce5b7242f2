"""The rule pages (``docs/rules/STxxx.md``) for ``safetorch explain``: shipped in the wheel as
``safetorch/_docs/rules`` (copied there by setup.py's build step), read from the checkout in a development install."""

from __future__ import annotations

import os

_HERE = os.path.dirname(os.path.abspath(__file__))
_PLACES = (os.path.join(_HERE, "_docs", "rules"), os.path.join(os.path.dirname(_HERE), "docs", "rules"))


def page(code: str) -> str | None:
    """The markdown page of rule ``code``, or None when this copy of safetorch has none."""
    for place in _PLACES:
        try:
            with open(os.path.join(place, f"{code}.md"), encoding="utf-8") as fh:
                return fh.read()
        except OSError:
            continue
    return None
