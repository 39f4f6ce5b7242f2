"""ST012 — rwth-i6/returnn#1595 (https://github.com/rwth-i6/returnn/pull/1595), "Torch: unscale gradients before noise
and clipping", for issue #1590: the updater clipped the global gradient norm while the gradients were still
multiplied by the grad scaler's scale; the fix unscales first. (GradScaler on the CPU here: the same calls.)"""
import torch
import torch.nn as nn


class Updater:
    def __init__(self, model, gradient_clip_global_norm=1.0):
        self.network = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        self.grad_scaler = torch.amp.GradScaler("cpu")
        self.gradient_clip_global_norm = gradient_clip_global_norm

    def step(self, loss):
        self.optimizer.zero_grad()
        self.grad_scaler.scale(loss).backward()
        if self.gradient_clip_global_norm:
            self.grad_scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.network.parameters(),
                                           max_norm=self.gradient_clip_global_norm)
        self.grad_scaler.step(self.optimizer)
        self.grad_scaler.update()


torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
updater = Updater(model)
for _ in range(3):
    updater.step(model(torch.randn(4, 8)).pow(2).mean())
