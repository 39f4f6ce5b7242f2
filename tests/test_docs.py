"""Every rule has its page in docs/rules/ (bad and good code, how to silence it) and its row in the README's table."""

from __future__ import annotations

import os

import pytest

import safetorch

from .conftest import ROOT


@pytest.mark.parametrize("code", sorted(safetorch.RULES))
def test_every_rule_has_a_page_with_code_and_a_way_to_silence_it(code: str) -> None:
    rule = safetorch.RULES[code]
    with open(os.path.join(ROOT, "docs", "rules", f"{code}.md")) as fh:
        page = fh.read()
    assert page.startswith(f"# {code} `{rule.name}`")
    assert "```python" in page and "Message:" in page
    assert f"# safetorch: ignore[{code}]" in page and f"SAFETORCH_IGNORE={code}" in page
    with open(os.path.join(ROOT, "README.md")) as fh:
        assert f"| [{code}](docs/rules/{code}.md) |" in fh.read()
