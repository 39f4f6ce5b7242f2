"""ST014 — torchgeo/torchgeo#4036 (https://github.com/torchgeo/torchgeo/issues/4036), "OlmoEarth pre-trained weights
are never loaded": the published checkpoints are keyed `encoder.*` and `decoder.*`, while `OlmoEarthPretrain_v1`
keeps the network in `self.model` (`model.encoder.*`), and `_olmoearth` ended with
`model.load_state_dict(state_dict, strict=False)`, which loaded none of them. Fixed in torchgeo/torchgeo#4044
(https://github.com/torchgeo/torchgeo/pull/4044); the later revision loads into `model.model` and asserts that no
key is missing or unexpected."""
import io

import torch
import torch.nn as nn


class Network(nn.Module):  # what the checkpoint was saved from
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16))
        self.decoder = nn.Linear(16, 8)


class OlmoEarthPretrain_v1(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = Network()


def get_state_dict():
    buffer = io.BytesIO()
    torch.save(Network().state_dict(), buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _olmoearth(weights):
    model = OlmoEarthPretrain_v1()
    if weights:
        missing_keys, unexpected_keys = model.model.load_state_dict(get_state_dict(), strict=False)
        assert not missing_keys
        assert not unexpected_keys
    return model


torch.manual_seed(0)
_olmoearth(weights=True).eval()
