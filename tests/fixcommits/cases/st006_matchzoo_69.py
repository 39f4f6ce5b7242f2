"""ST006 — NTMC-Community/MatchZoo-py#69 (https://github.com/NTMC-Community/MatchZoo-py/pull/69), "Add epsilon to log
function to avoid nan" (MatchZoo#772): the rank cross-entropy loss took `torch.log(F.softmax(logits))`, whose log is
infinite where a probability underflows to 0, and the loss became NaN; the fix adds an epsilon inside the log. The rule
reports where the NaN loss reaches `backward()`."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class RankCrossEntropyLoss(nn.Module):
    def __init__(self, num_neg=1):
        super().__init__()
        self.num_neg = num_neg

    def forward(self, y_pred, y_true):
        logits, labels = y_pred.view(-1, self.num_neg + 1), y_true.view(-1, self.num_neg + 1)
        return -torch.mean(torch.sum(labels * torch.log(F.softmax(logits, dim=-1)), dim=-1))


torch.manual_seed(0)
model = nn.Linear(4, 1)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
x = torch.randn(8, 4)
x[1::2] *= 0.0
with torch.no_grad():
    model.bias.fill_(-200.0)  # the negatives' scores collapse: their softmax underflows to 0
    model.weight.fill_(100.0)
y_true = torch.tensor([1.0, 0.0] * 4)
loss = RankCrossEntropyLoss()(model(x), y_true)
optimizer.zero_grad()
loss.backward()  # ST006: the loss is NaN
optimizer.step()
