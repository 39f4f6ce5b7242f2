"""ST002 — cezannec/capsule_net_pytorch#2 (https://github.com/cezannec/capsule_net_pytorch/pull/2), "fixed deprecation
warning in class CapsuleLoss": the reconstruction loss was `nn.MSELoss(size_average=False)`; the fix writes
`reduction='sum'`."""
import torch
import torch.nn as nn


class CapsuleLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.reconstruction_loss = nn.MSELoss(reduction="sum")

    def forward(self, x, labels, images, reconstructions):
        margin_loss = torch.relu(0.9 - x).pow(2).mul(labels).sum()
        reconstruction_loss = self.reconstruction_loss(reconstructions, images.view(images.size(0), -1))
        return (margin_loss + 0.0005 * reconstruction_loss) / images.size(0)


torch.manual_seed(0)
criterion = CapsuleLoss()
x = torch.rand(4, 10, requires_grad=True)
loss = criterion(x, torch.eye(10)[:4], torch.rand(4, 1, 4, 4), torch.rand(4, 16, requires_grad=True))
loss.backward()
