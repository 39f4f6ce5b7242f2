"""ST019 — fxia22/pointnet.pytorch#19 (https://github.com/fxia22/pointnet.pytorch/pull/19), "sets model to eval mode
(required due to batchnorm layer)": train_classification.py's final test loop ran the classifier in training mode
(the 2018 script, before torch.no_grad was added there too), folding the test batches into BatchNorm's statistics."""
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
classifier = nn.Sequential(nn.Linear(3, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Dropout(0.3), nn.Linear(64, 4))
optimizer = torch.optim.Adam(classifier.parameters(), lr=0.001, betas=(0.9, 0.999))
for _epoch in range(2):
    for _ in range(4):
        points, target = torch.randn(8, 3), torch.randint(0, 4, (8,))
        optimizer.zero_grad()
        classifier = classifier.train()
        pred = classifier(points)
        loss = F.cross_entropy(pred, target)
        loss.backward()
        optimizer.step()

total_correct = 0
total_testset = 0
for _ in range(6):
    points, target = torch.randn(8, 3), torch.randint(0, 4, (8,))
    classifier = classifier.eval()
    with torch.no_grad():
        pred = classifier(points)
    pred_choice = pred.data.max(1)[1]
    correct = pred_choice.eq(target.data).cpu().sum()
    total_correct += correct.item()
    total_testset += points.size()[0]
print(f"final accuracy {total_correct / float(total_testset)}")
