"""ST014 — pytorch/examples#1029 (https://github.com/pytorch/examples/issues/1029), "load_state_dict strict=False can
silently load a corrupted model": a Lightning checkpoint's keys start with `model.` (the LightningModule's attribute),
and `load_state_dict(state_dict, strict=False)` into the bare model loaded none of them; the fix strips the prefix and
loads strictly."""
import io

import torch
import torch.nn as nn


def make():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))


class LitModel(nn.Module):  # what the checkpoint was saved from
    def __init__(self):
        super().__init__()
        self.model = make()


torch.manual_seed(0)
buffer = io.BytesIO()
torch.save({"state_dict": LitModel().state_dict()}, buffer)
buffer.seek(0)
checkpoint = torch.load(buffer)
state_dict = checkpoint["state_dict"]
model = make()
model.load_state_dict(state_dict, strict=False)  # ST014: loads nothing: every key starts with 'model.'
model.eval()
