"""ST020 — pytorch/tutorials, advanced_source/neural_style_tutorial.py: the VGG loss network is only put in eval mode
(`cnn = vgg19(...).features.eval()`), and its parameters keep requiring grad while LBFGS optimizes the input image
through `step(closure)`: every closure call adds VGG's weight gradients to a `.grad` nobody reads. The tutorial's
later revision freezes it (`model.requires_grad_(False)`). A small stand-in for VGG: no download."""
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
cnn = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU()).eval()
content_img, style_img = torch.rand(1, 3, 16, 16), torch.rand(1, 3, 16, 16)


def gram_matrix(x):
    a, b, c, d = x.size()
    features = x.view(a * b, c * d)
    return torch.mm(features, features.t()) / (a * b * c * d)


content_target = cnn(content_img).detach()
style_target = gram_matrix(cnn(style_img)).detach()
input_img = torch.rand(1, 3, 16, 16).requires_grad_(True)
optimizer = torch.optim.LBFGS([input_img], max_iter=4)
run = [0]
while run[0] <= 12:
    def closure():
        with torch.no_grad():
            input_img.clamp_(0, 1)
        optimizer.zero_grad()
        features = cnn(input_img)
        loss = F.mse_loss(features, content_target) + 1e3 * F.mse_loss(gram_matrix(features), style_target)
        loss.backward()  # ST020: also computes cnn's weight gradients, which no optimizer holds
        run[0] += 1
        return loss

    optimizer.step(closure)
