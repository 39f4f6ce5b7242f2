"""ST001 — hunkim/PyTorchZeroToAll#6 (https://github.com/hunkim/PyTorchZeroToAll/pull/6): 11_3_hello_rnn_gpu.py moved
its inputs with `inputs.cuda()`, which returns a copy and leaves `inputs` where it was; the fix assigns the result.
The same call, on the device this machine has."""
import torch
import torch.nn as nn

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(777)
idx2char = ["h", "i", "e", "l", "o"]
x_data = [0, 1, 0, 2, 3, 3]  # hihell
y_data = [1, 0, 2, 3, 3, 4]  # ihello
inputs = torch.eye(5)[x_data].unsqueeze(0)
labels = torch.tensor(y_data)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.RNN(input_size=5, hidden_size=5, batch_first=True)

    def forward(self, x):
        out, _ = self.rnn(x)
        return out.view(-1, 5)


model = Model()
model.to(device)
inputs.to(device)  # ST001: returns a copy; inputs stays where it was
labels = labels.to(device)
criterion = nn.CrossEntropyLoss()
optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
for _epoch in range(5):
    optimizer.zero_grad()
    loss = criterion(model(inputs), labels)
    loss.backward()
    optimizer.step()
