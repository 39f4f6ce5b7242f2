"""ST008 — wkentaro/pytorch-fcn#56 (https://github.com/wkentaro/pytorch-fcn/pull/56, fixed in d10dd30), "Return to
train mode after validation": the trainer validates every few iterations inside an epoch, and validate() leaves the
model in eval mode, so training goes on with BatchNorm frozen and dropout off until the next epoch sets train()."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class Trainer:
    def __init__(self):
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Dropout2d(0.2),
                                   nn.Conv2d(8, 4, 1))
        self.optim = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.interval_validate = 3
        self.iteration = 0

    def validate(self):
        self.model.eval()
        with torch.no_grad():
            for _ in range(2):
                self.model(torch.randn(2, 3, 8, 8))
        self.model.train()

    def train_epoch(self):
        self.model.train()
        for _ in range(8):
            self.iteration += 1
            if self.iteration % self.interval_validate == 0:
                self.validate()
            data, target = torch.randn(2, 3, 8, 8), torch.randint(0, 4, (2, 8, 8))
            self.optim.zero_grad()
            loss = F.cross_entropy(self.model(data), target)
            loss.backward()
            self.optim.step()


Trainer().train_epoch()
