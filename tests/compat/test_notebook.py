"""safetorch in a real Jupyter kernel (ipykernel through nbclient; optional: ``pip install -e .[compat]``).

Findings name the cell as IPython does, strict-mode tracebacks end on the cell's line, crash notes appear, a
trailing semicolon (the notebook's way to discard a value) is a discard, and a re-run cell is the same call site.
"""

from __future__ import annotations

import os
import re
import sys
from typing import Any

import pytest

from safetorch import _run

from ..conftest import ROOT

# a Jupyter kernel.
pytestmark = pytest.mark.slow

CELLS = [
    "import torch, safetorch, warnings\nwarnings.simplefilter('always', safetorch.SafetorchWarning)",
    "x = torch.ones(2)\nx.double();",                                              # [2] ST001, semicolon
    "x.double()",                                                                   # [3] echoed: used
    "m = torch.nn.Linear(2, 2).eval()\nfor _ in range(3):\n    out = m(torch.ones(1, 2))",  # [4] ST003
    "a = torch.ones(2, 2)\na.double()\na @ torch.ones(2, 2, dtype=torch.float64)",  # [5] crash note
    "print(sorted({s.filename for s in safetorch._report.findings()}))",            # [6]
    "safetorch.install(strict=True)\nm2 = torch.nn.Linear(2, 2).eval()\nfor _ in range(2):\n    m2(torch.ones(1, 2))",
]


@pytest.fixture(scope="module")
def executed() -> list[Any]:
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in CELLS])
    # The kernel (ipykernel's own spec: this interpreter) imports the safetorch of this checkout, run from its root.
    # It is a run of its own: inheriting this process's run directory, its findings (provoked on purpose) would be
    # this test process's too, in the summary pytest's exit prints.
    inherited = os.environ.pop(_run.ENV, None)
    try:
        nbclient.NotebookClient(nb, timeout=300, startup_timeout=300, kernel_name="python3", allow_errors=True,
                                resources={"metadata": {"path": ROOT}}).execute()
    finally:
        if inherited is not None:
            os.environ[_run.ENV] = inherited
    return list(nb.cells)


def _text(cell: Any) -> str:
    out = []
    for o in cell.get("outputs", []):
        if o.get("output_type") == "stream":
            out.append(o["text"])
        elif o.get("output_type") == "error":
            out.append("\n".join(o["traceback"]))
        elif "data" in o:
            out.append(o["data"].get("text/plain", ""))
    return re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(out))


def test_findings_name_the_cell_and_show_its_line(executed: list[Any]) -> None:
    assert "Cell In[2]:2: DiscardedConversionWarning: ST001 x.double() returns a copy" in _text(executed[1])
    assert "\n  x.double();" in _text(executed[1])  # the cell's source line, as for a file
    assert "Warning" not in _text(executed[2])  # the last line's value is shown: it is used
    assert "Cell In[4]:3: EvalModeGradWarning: ST003 m (Linear)" in _text(executed[3])


def test_crash_notes_and_the_report_name_cells(executed: list[Any]) -> None:
    crash = _text(executed[4])
    assert "RuntimeError" in crash
    if sys.version_info >= (3, 11):  # a crash note is a PEP 678 exception note: 3.11+ (docs/limitations.md)
        assert "safetorch: Cell In[5]:2 discarded a conversion earlier" in crash
    assert "['Cell In[2]', 'Cell In[4]', 'Cell In[5]']" in _text(executed[5])


def test_strict_tracebacks_end_on_the_cells_line(executed: list[Any]) -> None:
    text = _text(executed[6])
    assert "SafetorchError: ST003 m2 (Linear)" in text
    assert "----> 4     m2(torch.ones(1, 2))" in text
    assert "torch/nn/modules/module.py" not in text and "safetorch/" not in text
