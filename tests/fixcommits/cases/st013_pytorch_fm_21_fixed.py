"""ST013 — rixwew/pytorch-fm#21 (https://github.com/rixwew/pytorch-fm/issues/21), fixed in 8ac848d: the attentional
factorization machine's attention called `F.dropout(attn_scores, p=...)` without `training=`, so dropout stayed on
after `model.eval()`; the fix passes `training=self.training`."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class AttentionalFactorizationMachine(nn.Module):
    def __init__(self, embed_dim=8, attn_size=4, dropouts=(0.2, 0.2)):
        super().__init__()
        self.attention = nn.Linear(embed_dim, attn_size)
        self.projection = nn.Linear(attn_size, 1)
        self.fc = nn.Linear(embed_dim, 1)
        self.dropouts = dropouts

    def forward(self, x):
        num_fields = x.shape[1]
        row, col = zip(*[(i, j) for i in range(num_fields - 1) for j in range(i + 1, num_fields)], strict=True)
        inner_product = x[:, list(row)] * x[:, list(col)]
        attn_scores = F.relu(self.attention(inner_product))
        attn_scores = F.softmax(self.projection(attn_scores), dim=1)
        attn_scores = F.dropout(attn_scores, p=self.dropouts[0], training=self.training)
        attn_output = torch.sum(attn_scores * inner_product, dim=1)
        attn_output = F.dropout(attn_output, p=self.dropouts[1], training=self.training)
        return self.fc(attn_output)


torch.manual_seed(0)
model = AttentionalFactorizationMachine()
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
for _ in range(2):
    optimizer.zero_grad()
    model(torch.randn(4, 3, 8)).pow(2).mean().backward()
    optimizer.step()
model.eval()
with torch.no_grad():
    model(torch.randn(4, 3, 8))
