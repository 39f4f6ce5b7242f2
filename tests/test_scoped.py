"""The public API for scoped and interactive use: `safetorch.ignore`, `safetorch.findings`, `safetorch.reset`."""

from __future__ import annotations

import asyncio
import threading
import warnings
from collections.abc import Iterator

import pytest
import torch

import safetorch


@pytest.fixture
def shown() -> Iterator[list[warnings.WarningMessage]]:
    """Every warning shown during the test, as it happens."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught


def _st(caught: list[warnings.WarningMessage]) -> list[warnings.WarningMessage]:
    return [w for w in caught if issubclass(w.category, safetorch.SafetorchWarning)]


def _discard(x: torch.Tensor) -> None:
    x.double()  # ST001 here


def test_ignore_as_a_block_switches_the_rule_off_there_only(shown: list[warnings.WarningMessage]) -> None:
    x = torch.ones(2)
    with safetorch.ignore("ST001"):
        _discard(x)
    assert _st(shown) == [] and safetorch.findings() == []
    with safetorch.ignore("eval-mode-grad"):  # another rule: ST001 still acts
        _discard(x)
    assert [w.category for w in _st(shown)] == [safetorch.DiscardedConversionWarning]
    found = safetorch.findings()
    assert [(f.code, f.name, f.lineno, f.count) for f in found] == [
        ("ST001", "discarded-conversion", _discard.__code__.co_firstlineno + 1, 1)]
    assert found[0].filename == __file__ and str(found[0]).startswith(f"{__file__}:")


def test_ignore_as_a_decorator_keeps_the_function(shown: list[warnings.WarningMessage]) -> None:
    @safetorch.ignore("ST001")
    def quiet(x: torch.Tensor) -> int:
        """Its docstring."""
        _discard(x)
        return 7

    assert quiet(torch.ones(2)) == 7 and quiet.__name__ == "quiet" and quiet.__doc__ == "Its docstring."
    assert _st(shown) == []
    _discard(torch.ones(2))  # outside the function: reported
    assert len(_st(shown)) == 1


def test_ignore_without_codes_is_every_rule_and_nests(shown: list[warnings.WarningMessage]) -> None:
    with safetorch.ignore():
        _discard(torch.ones(2))
    with safetorch.ignore("ST003"), safetorch.ignore("ST001"):
        _discard(torch.ones(2))
    assert _st(shown) == []
    with safetorch.ignore("ST001"):
        pass
    _discard(torch.ones(2))
    assert len(_st(shown)) == 1


def test_ignore_rejects_an_unknown_rule() -> None:
    with pytest.raises(ValueError, match=r"unknown rule 'ST01' in safetorch.ignore\(\); valid rules are ST001"):
        safetorch.ignore("ST01")


def test_ignore_is_local_to_its_thread(shown: list[warnings.WarningMessage]) -> None:
    inside, go = threading.Event(), threading.Event()

    def other() -> None:
        inside.wait(30)
        _discard(torch.ones(2))  # this thread is not inside the block
        go.set()

    thread = threading.Thread(target=other)
    thread.start()
    with safetorch.ignore("ST001"):
        inside.set()
        go.wait(30)
    thread.join(30)
    assert [f.code for f in safetorch.findings()] == ["ST001"]


def test_ignore_is_local_to_its_task(shown: list[warnings.WarningMessage]) -> None:
    @safetorch.ignore("ST001")
    async def quiet() -> None:
        await asyncio.sleep(0.01)
        _discard(torch.ones(2))

    async def loud() -> None:
        await asyncio.sleep(0.005)
        _discard(torch.ones(2))

    async def both() -> None:
        await asyncio.gather(quiet(), loud())

    asyncio.run(both())
    assert [f.count for f in safetorch.findings()] == [1]  # only the task outside the decorator


def test_reset_shows_a_finding_again(shown: list[warnings.WarningMessage]) -> None:
    _discard(torch.ones(2))
    _discard(torch.ones(2))
    assert [f.count for f in safetorch.findings()] == [2] and len(_st(shown)) == 1
    safetorch.reset()
    assert safetorch.findings() == []
    _discard(torch.ones(2))
    assert len(_st(shown)) == 2 and [f.count for f in safetorch.findings()] == [1]


def test_strict_mode_respects_the_scope() -> None:
    safetorch.install(strict=True)
    try:
        with safetorch.ignore("ST001"):
            _discard(torch.ones(2))
        with pytest.raises(safetorch.SafetorchError, match="^ST001"):
            _discard(torch.ones(2))
    finally:
        safetorch.install(strict=False)


def test_one_ignore_object_entered_in_two_threads(shown: list[warnings.WarningMessage]) -> None:
    quiet = safetorch.ignore("ST001")
    inside, errors = threading.Barrier(2, timeout=30), []

    def work() -> None:
        try:
            with quiet:
                inside.wait()
                _discard(torch.ones(2))
                inside.wait()
        except Exception as exc:  # a token reset in another context would raise ValueError here
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == [] and _st(shown) == []
    _discard(torch.ones(2))
    assert len(_st(shown)) == 1


def test_ignore_arguments() -> None:
    assert safetorch.ignore("ST001,eval-mode-grad").codes == {"ST001", "ST003"}
    assert safetorch.ignore(["ST004"], "ST007").codes == {"ST004", "ST007"}
    assert safetorch.ignore().codes == set(safetorch.RULES)
    with pytest.raises(ValueError, match="got no rule"):
        safetorch.ignore([])
    with pytest.raises(TypeError, match="cannot decorate the generator function .*gen.*with safetorch.ignore"):
        @safetorch.ignore("ST001")
        def gen() -> Iterator[int]:
            yield 1
