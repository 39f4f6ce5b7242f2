"""ST020 — KupynOrest/DeblurGAN#77 (https://github.com/KupynOrest/DeblurGAN/issues/77), "perceptual loss pretrained":
the perceptual loss's VGG (conv3_3 features) was only put in eval mode, never given `requires_grad = False`, so every
generator backward also computed VGG's weight gradients, which no optimizer holds. The fix freezes it. A small
stand-in for VGG: no download."""
import torch
import torch.nn as nn


class PerceptualLoss:
    def __init__(self, loss=None):
        self.criterion = loss or nn.MSELoss()
        self.contentFunc = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1)).eval()

    def get_loss(self, fakeIm, realIm):
        f_fake = self.contentFunc.forward(fakeIm)
        f_real = self.contentFunc.forward(realIm)
        return self.criterion(f_fake, f_real.detach())


torch.manual_seed(0)
netG = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 3, 3, padding=1))
optimizer_G = torch.optim.Adam(netG.parameters(), lr=1e-4, betas=(0.5, 0.999))
content_loss = PerceptualLoss()
for _ in range(5):
    blurred, sharp = torch.randn(2, 3, 8, 8), torch.randn(2, 3, 8, 8)
    optimizer_G.zero_grad()
    loss_G = content_loss.get_loss(netG(blurred), sharp) * 100
    loss_G.backward()  # ST020: also computes contentFunc's weight gradients, which no optimizer holds
    optimizer_G.step()
