"""What the H×W loss wrappers share: the divisor, read from the input's shape, and its checks."""

from __future__ import annotations

import math

import torch

BY = ("hw", "nhw")


def check_by(by: str) -> str:
    if by not in BY:
        raise ValueError(f"by={by!r}: use by='hw' (divide by the spatial size H×W) or by='nhw' (also by the batch N)")
    return by


def divisor(input: torch.Tensor, by: str) -> int:
    """The product of the spatial dimensions (every dimension after N, C), times N for ``by='nhw'``."""
    shape = tuple(input.shape)
    if len(shape) < 3:
        raise ValueError(f"input of shape {shape} has no spatial dimensions: an H×W-normalised loss needs (N, C, L), "
                         f"(N, C, H, W) or (N, C, D, H, W)")
    counted = shape[2:] if by == "hw" else (shape[0], *shape[2:])
    if 0 in counted:
        raise ValueError(f"input of shape {shape} has a zero-sized {'batch or ' if by == 'nhw' else ''}spatial "
                         f"dimension: the normalised loss would be NaN")
    return math.prod(counted)
