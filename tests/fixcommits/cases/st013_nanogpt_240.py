"""ST013 — karpathy/nanoGPT#240 (https://github.com/karpathy/nanoGPT/pull/240): the flash-attention path of
CausalSelfAttention passed `dropout_p=self.dropout` to scaled_dot_product_attention whatever the module's mode, so
estimate_loss() in eval mode still dropped attention weights; the fix passes `self.dropout if self.training else 0`."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd=16, n_head=2, dropout=0.2):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head, self.n_embd, self.dropout = n_head, n_embd, dropout

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None,  # ST013: dropout_p applies in eval mode too
                                           dropout_p=self.dropout, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


@torch.no_grad()
def estimate_loss(model, eval_iters=3):
    model.eval()
    losses = torch.zeros(eval_iters)
    for k in range(eval_iters):
        x = torch.randn(2, 8, 16)
        losses[k] = model(x).pow(2).mean().item()
    model.train()
    return losses.mean()


torch.manual_seed(0)
model = CausalSelfAttention()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for it in range(4):
    if it % 2 == 0:
        estimate_loss(model)
    optimizer.zero_grad()
    model(torch.randn(2, 8, 16)).pow(2).mean().backward()
    optimizer.step()
