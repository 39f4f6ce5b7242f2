"""ST012 — milesial/Pytorch-UNet#470 (https://github.com/milesial/Pytorch-UNet/pull/470), "Unscale gradients before
clipping", for issue #468: train.py clipped the gradients with `clip_grad_norm_` right after the scaled backward, so
it clipped gradients still multiplied by the loss scale; the fix calls `grad_scaler.unscale_(optimizer)` first.
(GradScaler on the CPU here: the same calls.)"""
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 2, 1))
optimizer = torch.optim.RMSprop(model.parameters(), lr=1e-5, weight_decay=1e-8, momentum=0.999)
grad_scaler = torch.amp.GradScaler("cpu", enabled=True)
for _ in range(3):
    images, true_masks = torch.randn(2, 3, 8, 8), torch.randint(0, 2, (2, 8, 8))
    with torch.autocast("cpu", enabled=True, dtype=torch.bfloat16):
        masks_pred = model(images)
        loss = F.cross_entropy(masks_pred.float(), true_masks)
    optimizer.zero_grad(set_to_none=True)
    grad_scaler.scale(loss).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # ST012: the gradients are still scaled
    grad_scaler.step(optimizer)
    grad_scaler.update()
