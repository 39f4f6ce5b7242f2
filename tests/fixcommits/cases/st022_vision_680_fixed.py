"""ST022 — pytorch/vision#680 (https://github.com/pytorch/vision/issues/680), "ToTensor aliases input data and
operations like Normalize work in-place": a data loader with its images in RAM converted each one without a copy and
normalised it in place, so "as training progresses, the dataset becomes more and more normalized"; fixed in
torchvision by making Normalize out of place (#699). Here the same two steps in a dataset's __getitem__."""
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

MEAN, STD = 0.5, 0.25


class InMemoryImages(Dataset):
    def __init__(self):
        self.images = np.random.RandomState(0).rand(8, 1, 4, 4).astype(np.float32)

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        img = torch.from_numpy(self.images[i])
        return (img - MEAN) / STD


dataset = InMemoryImages()
for _epoch in range(2):
    for batch in DataLoader(dataset, batch_size=4, shuffle=False):
        batch.mean()
