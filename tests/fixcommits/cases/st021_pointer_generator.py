"""ST021 — a public pointer-generator summariser's Trainer.train_one_batch checks `loss.item() == float('nan')`
after each step, a check that never fires (its run_one_epoch repeats it on the running average); the fix kind is
conbench/conbench#1166 (https://github.com/conbench/conbench/pull/1166), where `value == math.nan` became
`math.isnan(value)`."""
import math

import torch
import torch.nn as nn


class Trainer:
    def __init__(self):
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))
        self.optimizer = torch.optim.Adagrad(self.model.parameters(), lr=0.15)

    def train_one_batch(self, batch):
        self.optimizer.zero_grad()
        loss = (self.model(batch) - batch).pow(2).mean()
        loss.backward()
        nn.utils.clip_grad_norm_(self.model.parameters(), 2.0)
        self.optimizer.step()
        if loss.item() == float("nan"):  # ST021: always False
            print("nan")
        return loss.item()

    def run_one_epoch(self):
        running_avg_loss = 0.0
        for _ in range(4):
            loss = self.train_one_batch(torch.randn(4, 8))
            running_avg_loss = 0.99 * running_avg_loss + 0.01 * loss
            if math.isnan(running_avg_loss):
                print("get NaN")
                break


Trainer().run_one_epoch()
