"""ST002 — Tianxiaomo/pytorch-YOLOv4#192 (https://github.com/Tianxiaomo/pytorch-YOLOv4/pull/192), "fix: deprecated
'size_average'": the YOLO loss summed its binary cross-entropy terms with `size_average=False`; the fix writes
`reduction='sum'`."""
import torch
import torch.nn.functional as F

torch.manual_seed(0)
output = torch.randn(2, 3, 4, 4, requires_grad=True)
target = torch.randint(0, 2, (2, 3, 4, 4)).float()
obj_mask = torch.ones_like(target)
for _ in range(3):
    loss_obj = F.binary_cross_entropy(torch.sigmoid(output), target, weight=obj_mask,  # ST002: legacy argument
                                      size_average=False)
    loss_obj.backward()
