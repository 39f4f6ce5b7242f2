"""ST007 — huggingface/transformers#31530 (https://github.com/huggingface/transformers/pull/31530), "Removed
torch.cuda.empty_cache from train loop" (issue #31372: the call added in #28769 slowed training down): the trainer
emptied the CUDA cache after every training step."""
import torch
import torch.nn as nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)


def training_step(model, inputs):
    loss = ((model(inputs["x"]) - inputs["y"]) ** 2).mean()
    loss.backward()
    return loss.detach()


for _ in range(12):
    optimizer.zero_grad()
    training_step(model, {"x": torch.randn(8, 16), "y": torch.randn(8, 1)})
    optimizer.step()
