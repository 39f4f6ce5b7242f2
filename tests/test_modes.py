"""What eval mode changes in a module (`safetorch._modes`): what ST008 names, and without which it is silent."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch.nn as nn

from safetorch._modes import eval_effects, joined


class _FrozenNorms(nn.Module):
    """mmcv's ``norm_eval``: a ``train()`` override that keeps its own layers in eval mode."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def train(self, mode: bool = True) -> _FrozenNorms:
        return super().train(mode)


@pytest.mark.parametrize(("make", "effects"), [
    (lambda: nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Conv1d(2, 2, 1), nn.Embedding(3, 2), nn.LayerNorm(2)), []),
    (lambda: nn.LSTM(2, 2, num_layers=1, dropout=0.0), []),
    (lambda: nn.LSTM(2, 2, num_layers=2, dropout=0.1), ["dropout is off"]),
    (lambda: nn.MultiheadAttention(4, 2, dropout=0.1), ["dropout is off"]),
    (lambda: nn.MultiheadAttention(4, 2), []),
    (lambda: nn.Sequential(nn.AlphaDropout(0.1), nn.Dropout2d(0.0)), ["dropout is off"]),
    (lambda: nn.Sequential(nn.InstanceNorm1d(2, track_running_stats=True), nn.BatchNorm2d(2)),
     ["InstanceNorm and BatchNorm use their running statistics"]),
    (lambda: nn.RReLU(), ["RReLU reads self.training"]),
    (lambda: _FrozenNorms(), ["_FrozenNorms overrides train()"]),
])
def test_the_effects_of_eval_mode_by_model(make: Callable[[], nn.Module], effects: list[str]) -> None:
    assert eval_effects(make().eval()) == effects


def test_a_submodule_put_back_in_training_mode_counts_for_nothing() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2), nn.Dropout(0.5)).eval()
    model[2].train()
    assert eval_effects(model) == ["BatchNorm uses its running statistics"]
    assert eval_effects(model.train()) == []


def test_joined() -> None:
    assert [joined(c) for c in ([], ["a"], ["a", "b"], ["a", "b", "c"])] == ["", "a", "a and b", "a, b and c"]


def test_a_forward_hook_that_reads_the_mode_counts() -> None:
    """The old ``torch.nn.utils.spectral_norm``: a pre-hook runs the power iteration in training mode only."""
    model = nn.Sequential(nn.utils.spectral_norm(nn.Linear(2, 2))).eval()
    assert eval_effects(model) == ["a forward hook on Linear reads its .training"]
    model = nn.Sequential(nn.Linear(2, 2))
    model[0].register_forward_hook(lambda module, args, out: out * 2)
    assert eval_effects(model.eval()) == []
