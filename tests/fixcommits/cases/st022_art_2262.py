"""ST022 — Trusted-AI/adversarial-robustness-toolbox#2262 (https://github.com/Trusted-AI/adversarial-robustness-toolbox/issues/2262),
"PyTorchYolo and PyTorchObjectDetector modify the original numpy array": the estimator converted the caller's images
with `torch.from_numpy` and normalised them in place, so every predict() changed the array the caller keeps, and a
second predict() on it saw images divided twice. The fix copies first."""
import numpy as np
import torch
import torch.nn as nn


class PyTorchObjectDetector:
    def __init__(self, model, clip_values=(0, 255)):
        self.model, self.clip_values = model, clip_values

    def _preprocess(self, x):
        x_tensor = torch.from_numpy(x)  # ST022: the caller's array, changed in place below
        x_tensor /= self.clip_values[1]
        return x_tensor

    def predict(self, x):
        with torch.no_grad():
            return self.model(self._preprocess(x))


torch.manual_seed(0)
detector = PyTorchObjectDetector(nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 4)).eval())
images = np.random.RandomState(0).randint(0, 256, (2, 3, 8, 8)).astype(np.float32)
first = detector.predict(images)
second = detector.predict(images)  # the same images: the caller expects the same predictions
