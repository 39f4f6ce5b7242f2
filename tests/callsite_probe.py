"""Run by test_callsite.py under every Python 3.10-3.13 found: exercises the call-site reader without torch.

Prints one JSON object {tag: answer}. Loads safetorch/_callsite.py by path: it imports only the standard library.
"""

import importlib.util
import json
import os
import sys

here = os.path.dirname(os.path.abspath(__file__))
spec = importlib.util.spec_from_file_location("_callsite", os.path.join(here, "..", "safetorch", "_callsite.py"))
cs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cs)

results = {}


def probe(tag):
    results[tag] = cs.is_discarded(sys._getframe(1))
    return tag


class Acc:
    def __init__(self, tag):
        self.tag = tag

    def __radd__(self, other):
        results[self.tag] = cs.accumulates(sys._getframe(1))
        return other

    def __mul__(self, other):
        return self


class Key:
    """A method that is both a key function (called from C by list.sort) and called as a statement."""

    tag = ""

    def probe(self):
        frame = sys._getframe(1)
        results[Key.tag] = cs.is_discarded(frame) and cs.calls_method(frame, "probe") is not False
        return 0

    def __lt__(self, other):
        return False


def identity(v):
    return v


def module_level_forms():
    pass


probe("m.discarded")
m_assigned = probe("m.assigned")
[probe("m.comprehension") for _ in range(1)]
identity(probe("m.argument"))
m_cond = probe("m.conditional") if m_assigned else None
(lambda: probe("m.lambda"))()
m_acc = 0.0
m_acc += Acc("m.iadd")
m_acc = m_acc + Acc("m.add_same_name")
m_y = 1 + Acc("m.plain_add")
m_scale = 0.5 + Acc("m.scaled") * 2
m_other = m_acc + Acc("m.other_name")


def function_forms():
    probe("f.discarded")
    a = probe("f.assigned")
    probe("f.chained").upper()
    b = [probe("f.comprehension") for _ in range(1)]
    identity(probe("f.argument"))
    c = probe("f.conditional") if a else None
    acc = 0.0
    for _ in range(2):
        acc += Acc("f.iadd")
    acc = acc + Acc("f.add_same_name")
    y = 1 + Acc("f.plain_add")
    total = 0
    total = total + Acc("f.add_same_name_int")
    other = acc + Acc("f.other_name")
    scale = 0.5 + Acc("f.scaled") * 2
    one = 0.0; one = one + Acc("f.one_line_add")  # noqa: E702  (3.13 fuses the store and the load)
    two = three = 0; two = two + Acc("f.chained_store_add")  # noqa: E702
    ks = [Key(), Key()]
    Key.tag = "k.key_function"
    ks.sort(key=Key.probe)  # a key function, called from C: not a call at this line whose result is dropped
    Key.tag = "k.method_call"
    Key().probe()
    return probe("f.returned"), b, c, y, total, other, scale, one, two, three


function_forms()
print(json.dumps({"version": list(sys.version_info[:2]), "results": results}))
