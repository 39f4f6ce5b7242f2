"""Real frameworks, where they install from the registry (optional test dependencies: ``pip install -e .[compat]``).

Tiny random-config models, saved and loaded from a temporary directory: no downloads.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

import safetorch
from safetorch import EvalModeTrainingWarning

from ..conftest import findings, lineno
from ..test_eval_mode_grad import keeps_activations

# transformers models and its Trainer.
pytestmark = pytest.mark.slow


def _tiny_bert(path: str) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=32, num_labels=2)
    torch.manual_seed(0)
    transformers.BertForSequenceClassification(config).save_pretrained(path)


def _fine_tune(path: str, steps: int = 3) -> tuple[dict[str, torch.Tensor], list[float], list[Any]]:
    """A plain fine-tuning loop that never calls model.train(): from_pretrained returns the model in eval mode."""
    transformers = pytest.importorskip("transformers")
    model = transformers.BertForSequenceClassification.from_pretrained(path)
    assert not model.training
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.manual_seed(1)
    losses = []
    with findings() as got:
        for _ in range(steps):
            ids, labels = torch.randint(0, 64, (4, 8)), torch.randint(0, 2, (4,))
            out = model(input_ids=ids, labels=labels); line = lineno()  # noqa: E702
            out.loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(out.loss.item())
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses, [(w, line) for w in got]


def test_a_from_pretrained_bert_fine_tuned_without_train_runs_to_the_end_with_st008(tmp_path: Any) -> None:
    _tiny_bert(str(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        weights_on, losses_on, got = _fine_tune(str(tmp_path))
        safetorch.uninstall()
        try:
            weights_off, losses_off, _ = _fine_tune(str(tmp_path))
        finally:
            safetorch.install()
    assert losses_on == losses_off
    assert all(torch.equal(weights_on[k], weights_off[k]) for k in weights_off)
    ours = [(w.category, w.filename, w.lineno, str(w.message)) for w, _ in got
            if issubclass(w.category, safetorch.SafetorchWarning)]
    line = got[0][1]
    assert [o[:3] for o in ours] == [(EvalModeTrainingWarning, __file__, line)]
    message = ours[0][3]
    assert message.startswith("ST008 model (BertForSequenceClassification) is trained in eval mode")
    assert "PreTrainedModel.from_pretrained() at " in message and "modeling_utils.py:" in message
    assert "Write: model.train() before the training loop" in message


def test_evaluating_a_from_pretrained_bert_without_no_grad_gets_st003(tmp_path: Any) -> None:
    _tiny_bert(str(tmp_path))
    transformers = pytest.importorskip("transformers")
    model = transformers.BertForSequenceClassification.from_pretrained(str(tmp_path))
    kept = []
    with findings() as got:
        for _ in range(4):  # a validation loop: each batch's logits die at the next one
            logits, k = keeps_activations(lambda: model(input_ids=torch.randint(0, 64, (2, 8))).logits)
            kept.append(k)
            logits.argmax(-1)
    assert kept == [True, False, False, False]  # watched, then checkpointed: no activations kept
    assert [w.category for w in got if issubclass(w.category, safetorch.SafetorchWarning)] == [
        safetorch.EvalModeGradWarning]


def test_the_hugging_face_trainer_loop_is_silent_and_trains_identically(tmp_path: Any) -> None:
    """Trainer's own loop — gradient accumulation, clipping, its own zero_grad, AdamW, a scheduler, evaluation — is
    a look-alike of every step rule (ST010–ST015): silent, and the same weights with safetorch on and off."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    _tiny_bert(str(tmp_path / "bert"))

    class Rows(torch.utils.data.Dataset):  # type: ignore[type-arg]
        def __len__(self) -> int:
            return 16

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            g = torch.Generator().manual_seed(i)
            return {"input_ids": torch.randint(0, 64, (8,), generator=g), "labels": torch.tensor(i % 2)}

    def train() -> dict[str, torch.Tensor]:
        model = transformers.BertForSequenceClassification.from_pretrained(str(tmp_path / "bert"))
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, per_device_eval_batch_size=4,
            gradient_accumulation_steps=2, max_grad_norm=1.0, num_train_epochs=2, learning_rate=1e-3,
            logging_strategy="no", save_strategy="no", eval_strategy="epoch", report_to=[], use_cpu=True, seed=0,
            dataloader_num_workers=0, disable_tqdm=True)
        transformers.Trainer(model=model, args=args, train_dataset=Rows(), eval_dataset=Rows()).train()
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    with findings() as got:
        on = train()
    assert [(w.category.__name__, str(w.message)[:80]) for w in got] == []
    safetorch.uninstall()
    off = train()
    safetorch.install()
    assert on.keys() == off.keys() and all(torch.equal(on[k], off[k]) for k in on)


def _bert_fine_tuned_then_evaluated(path: str, evaluate: str) -> tuple[list[torch.Tensor], list[Any], int | None]:
    """model.train(), a few steps, then an evaluation of held-out batches: ``evaluate`` is "as written" (neither
    eval() nor no_grad: ST019) or "right" (eval() and no_grad). Its numbers, its findings, the evaluation's line."""
    transformers = pytest.importorskip("transformers")
    model = transformers.BertForSequenceClassification.from_pretrained(path)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.manual_seed(1)
    logits, line = [], None
    with findings() as got:
        for _ in range(3):
            out = model(input_ids=torch.randint(0, 64, (4, 8)), labels=torch.randint(0, 2, (4,)))
            out.loss.backward()
            opt.step()
            opt.zero_grad()
        held_out = [torch.randint(0, 64, (4, 8)) for _ in range(6)]
        if evaluate == "right":
            model.eval()
            with torch.no_grad():
                logits = [model(input_ids=ids).logits for ids in held_out]
        else:
            for ids in held_out:
                logits.append(model(input_ids=ids).logits.detach()); line = lineno()  # noqa: E702
    return [*logits, *(p.detach().clone() for p in model.parameters())], got, line


@pytest.mark.parametrize("evaluate", ["as written", "right"])
def test_a_bert_evaluated_in_training_mode_gets_st019_and_the_right_evaluation_does_not(
        tmp_path: Any, evaluate: str) -> None:
    _tiny_bert(str(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        on, got, line = _bert_fine_tuned_then_evaluated(str(tmp_path), evaluate)
        safetorch.uninstall()
        try:
            off, _, _ = _bert_fine_tuned_then_evaluated(str(tmp_path), evaluate)
        finally:
            safetorch.install()
    assert [(w.category, w.lineno) for w in got] == ([] if line is None else
                                                    [(safetorch.EvaluationInTrainModeWarning, line)])
    assert len(on) == len(off) and all(torch.equal(a, b) for a, b in zip(on, off, strict=True))
