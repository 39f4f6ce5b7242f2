"""ST015 — CSCYQJ/MICCAI23-ProtoContra-SFDA#18 (https://github.com/CSCYQJ/MICCAI23-ProtoContra-SFDA/issues/18),
"It seems like the last layer is not frozen?": the adaptation stage froze the segmentation head with
`self.model.outc.requires_grad = False`, a plain attribute of the module, and then built the optimizer over all of the
model's parameters, so the head was trained anyway; the fix is `requires_grad_(False)` (the reporter's, confirmed by
the authors). The rule reports at the freeze's line, the one the fix changes, naming the optimizer that proves it."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class UNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inc = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU())
        self.outc = nn.Conv2d(8, 2, 1)

    def forward(self, x):
        return self.outc(self.inc(x))


class Adapter:
    def __init__(self):
        torch.manual_seed(0)
        self.model = UNet()
        self.model.outc.requires_grad = False  # ST015: outc is still trained
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-4)

    def adapt(self, steps=2):
        for _ in range(steps):
            x = torch.randn(2, 1, 8, 8)
            self.optimizer.zero_grad()
            loss = F.cross_entropy(self.model(x), torch.randint(0, 2, (2, 8, 8)))
            loss.backward()
            self.optimizer.step()


Adapter().adapt()
