"""ST014: load_state_dict(strict=False) that loaded (almost) nothing: a key prefix."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import safetorch
from safetorch import SafetorchError, StateDictLoadedNothingWarning

from .conftest import findings, lineno


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))


@pytest.mark.parametrize("prefix", ["module.", "_orig_mod.", "model."])
def test_a_prefixed_checkpoint_warns_and_names_the_prefix(prefix: str) -> None:
    saved = {prefix + k: v for k, v in _net().state_dict().items()}
    model = _net()
    with findings() as got:
        result = model.load_state_dict(saved, strict=False); line = lineno()  # noqa: E702
    assert [(w.category, w.filename, w.lineno) for w in got] == [(StateDictLoadedNothingWarning, __file__, line)]
    message = str(got[0].message)
    assert message.startswith("ST014 load_state_dict(..., strict=False) loaded 0 of the model's 4 keys from 4 given")
    assert f"The checkpoint's keys start with {prefix!r} (e.g. '{prefix}0.weight')" in message
    assert f"k.removeprefix({prefix!r})" in message
    assert len(result.unexpected_keys) == 4  # torch's result, untouched


def test_a_model_wrapped_after_saving_names_the_models_prefix() -> None:
    saved = _net().state_dict()
    wrapper = nn.Module()
    wrapper.net = _net()
    with findings() as got:
        wrapper.load_state_dict(saved, strict=False)
    assert [w.category for w in got] == [StateDictLoadedNothingWarning]
    assert "The model's keys start with 'net.' (e.g. 'net.0.weight')" in str(got[0].message)


def test_another_models_checkpoint() -> None:
    with findings() as got:
        _net().load_state_dict({"encoder.weight": torch.ones(2)}, strict=False)
    assert "No prefix makes them match" in str(got[0].message)


def test_look_alikes_stay_silent_and_load_what_torch_loads() -> None:
    backbone = _net()
    bigger = nn.Sequential(_net(), nn.Linear(2, 2))
    with findings() as got:
        bigger[0].load_state_dict(backbone.state_dict(), strict=False)  # exact match
        bigger.load_state_dict({f"0.{k}": v for k, v in backbone.state_dict().items()}, strict=False)  # backbone
        small = nn.Linear(4, 4)
        small.load_state_dict({"weight": torch.ones(4, 4), "bias": torch.ones(4),
                               **{f"head{i}.weight": torch.ones(1) for i in range(30)}}, strict=False)  # extra heads
        big = nn.Sequential(*[nn.Linear(2, 2) for _ in range(30)])
        big.load_state_dict({"0.weight": torch.ones(2, 2)}, strict=False)  # an adapter-sized partial load
        _net().load_state_dict({}, strict=False)
    assert got == []
    assert torch.equal(bigger[0][0].weight, backbone[0].weight) and torch.equal(small.weight, torch.ones(4, 4))


def test_strict_true_is_torchs_error() -> None:
    with findings() as got, pytest.raises(RuntimeError, match="Unexpected key"):
        _net().load_state_dict({"module." + k: v for k, v in _net().state_dict().items()})
    assert got == []


def test_strict_mode_raises_at_the_load_line() -> None:
    safetorch.install(strict=True)
    line = lineno() + 2
    with pytest.raises(SafetorchError) as info:
        _net().load_state_dict({"module." + k: v for k, v in _net().state_dict().items()}, strict=False)
    assert (info.value.code, info.value.lineno) == ("ST014", line)
