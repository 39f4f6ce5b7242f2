"""ST008 — fartashf/vsepp#4 (https://github.com/fartashf/vsepp/issues/4), "Finish validation without running
model.train()": train.py validates every `val_step` iterations, validate() calls `model.val_start()` (eval mode), and
`model.train_start()` runs again only at the next epoch, so training goes on without dropout and with BatchNorm
frozen. The fix calls train_start() after validating; the rule reports the training forward of the model left in
eval mode."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class VSE:
    def __init__(self):
        torch.manual_seed(0)
        self.img_enc = nn.Sequential(nn.Linear(32, 16), nn.BatchNorm1d(16), nn.Dropout(0.2))
        self.optimizer = torch.optim.Adam(self.img_enc.parameters(), lr=2e-4)
        self.Eiters = 0

    def train_start(self):
        self.img_enc.train()

    def val_start(self):
        self.img_enc.eval()

    def train_emb(self, images, targets):
        self.Eiters += 1
        img_emb = self.img_enc(images)  # ST008: the encoder validate() left in eval mode
        loss = F.mse_loss(img_emb, targets)
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()


def validate(model):
    model.val_start()
    with torch.no_grad():
        model.img_enc(torch.randn(4, 32))


model = VSE()
for _epoch in range(2):
    model.train_start()
    for _ in range(6):
        model.train_emb(torch.randn(4, 32), torch.randn(4, 16))
        if model.Eiters % 3 == 0:
            validate(model)
