"""ST022: a tensor sharing memory with a NumPy array changed in place (changing the array), or one reused buffer kept
as many tensors."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import safetorch
from safetorch import SafetorchError, SharedMemoryWarning

from .conftest import findings, lineno

MEAN, STD = 1.0, 2.0


class Normalised(Dataset):  # type: ignore[type-arg]
    """Seed post 003, item 8: items converted without a copy, then normalised in place."""

    line = 0

    def __init__(self, convert: Callable[[Any], torch.Tensor] | None = None) -> None:
        self.data = np.arange(24, dtype=np.float32).reshape(6, 4)
        self.convert = convert

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.convert is not None:
            x = self.convert(self.data[i])
        else:
            x = torch.from_numpy(self.data[i]); Normalised.line = lineno()  # noqa: E702
        return x.sub_(MEAN).div_(STD)


def _epochs(dataset: Dataset, epochs: int = 2, batch_size: int = 1) -> list[torch.Tensor]:  # type: ignore[type-arg]
    seen = []
    for _ in range(epochs):
        for batch in DataLoader(dataset, batch_size=batch_size):
            seen.append(batch)
    return seen


@pytest.mark.parametrize("batch_size", [1, 4])
def test_a_dataset_normalised_in_place_warns_at_its_conversion_in_the_second_epoch(batch_size: int) -> None:
    dataset = Normalised()
    with findings() as got:
        seen = _epochs(dataset, batch_size=batch_size)
    assert [(w.category, w.filename, w.lineno) for w in got] == [(SharedMemoryWarning, __file__, Normalised.line)]
    message = str(got[0].message)
    assert message.startswith("ST022 torch.from_numpy(self.data[i]) returns a tensor over the array's own memory, "
                              "and the tensor this line made from it before was changed in place")
    assert "Write: torch.from_numpy(self.data[i]).clone()" in message
    # what the finding is about: the second epoch normalised the stored data again
    assert float(seen[0].flatten()[1]) == (1 - MEAN) / STD
    assert float(dataset.data[0, 1]) == ((1 - MEAN) / STD - MEAN) / STD


def test_as_tensor_warns_too() -> None:
    with findings() as got:
        _epochs(Normalised(lambda a: torch.as_tensor(a)))
    assert [w.category for w in got] == [SharedMemoryWarning]
    assert str(got[0].message).startswith("ST022 torch.as_tensor(a) returns a tensor over the array's own memory")


def test_one_buffer_kept_as_many_batches_warns_at_the_line_that_keeps_it() -> None:
    buf = np.zeros(4, dtype=np.float32)
    batches = []
    with findings() as got:
        for k in range(5):
            buf[:] = k  # the loader refills its one buffer
            batches.append(torch.from_numpy(buf)); line = lineno()  # noqa: E702
    assert [(w.category, w.filename, w.lineno) for w in got] == [(SharedMemoryWarning, __file__, line)]
    assert str(got[0].message).startswith(
        "ST022 torch.from_numpy(buf) returns a tensor over the array's own memory, and 2 tensors this line made from "
        "the same array are still kept while it has been refilled since")
    assert str(got[0].message).endswith("Write: torch.from_numpy(buf).clone() (safetorch explain ST022)")
    assert all(b.tolist() == [4.0] * 4 for b in batches)  # five identical batches


def _sum(x: torch.Tensor) -> torch.Tensor:
    return x.sum()


SILENT: dict[str, Callable[[], Any]] = {
    "read-only use": lambda: _epochs(Normalised(lambda a: torch.from_numpy(a) * 2), epochs=3),
    "a .clone() first": lambda: _epochs(Normalised(lambda a: torch.from_numpy(a).clone()), epochs=3),
    "a .copy() first": lambda: _epochs(Normalised(lambda a: torch.from_numpy(a.copy())), epochs=3),
    "a tensor that owns its memory": lambda: _epochs(Normalised(lambda a: torch.tensor(a)), epochs=3),
    "as_tensor that copied": lambda: _epochs(Normalised(lambda a: torch.as_tensor(a, dtype=torch.float64)), epochs=3),
}


@pytest.mark.parametrize("case", sorted(SILENT))
def test_datasets_that_do_not_change_their_data_are_silent(case: str) -> None:
    with findings() as got:
        SILENT[case]()
    assert got == []


def test_an_array_converted_once_and_changed_in_place_on_purpose_is_silent() -> None:
    a = np.ones((3, 4), dtype=np.float32)
    with findings() as got:
        for i in range(3):
            torch.from_numpy(a[i]).mul_(i)  # each row once: the program means to change the array
        t = torch.from_numpy(a)
        t.add_(1)
    assert got == [] and a[2, 0] == 3.0


def test_a_streaming_buffer_used_and_dropped_each_step_is_silent() -> None:
    buf = np.zeros(4, dtype=np.float32)
    total = []
    kept = [torch.from_numpy(np.full(4, k, dtype=np.float32)) for k in range(5)]  # distinct arrays, all kept
    same = np.ones(4, dtype=np.float32)
    with findings() as got:
        for k in range(10):
            buf[:] = k
            t = torch.as_tensor(buf)  # the previous step's tensor is still bound to t here
            total.append(_sum(t).item())
            kept.append(torch.from_numpy(same))  # one array kept many times, never refilled
    assert got == [] and total == [4.0 * k for k in range(10)]


def test_the_watch_keeps_no_array_alive() -> None:
    a = np.ones(1 << 16, dtype=np.float32)
    array = weakref.ref(a)
    t = torch.from_numpy(a)
    t.add_(1)
    del a, t
    gc.collect()
    assert array() is None


def test_strict_mode_raises_at_the_conversion() -> None:
    safetorch.install(strict=True)
    with pytest.raises(SafetorchError) as info:
        _epochs(Normalised())
    assert (info.value.code, info.value.lineno) == ("ST022", Normalised.line)


def test_uninstall_restores_torchs_functions() -> None:
    assert type(torch.from_numpy).__name__ == type(torch.as_tensor).__name__ == "function"  # ST022's, in place
    safetorch.uninstall()
    assert type(torch.from_numpy).__name__ == type(torch.as_tensor).__name__ == "builtin_function_or_method"
    with findings() as got:
        _epochs(Normalised())
    assert got == []
