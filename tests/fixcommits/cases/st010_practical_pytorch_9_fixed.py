"""ST010 — spro/practical-pytorch#9 (https://github.com/spro/practical-pytorch/issues/9), fixed in 67ac021:
char-rnn-classification built its optimizer over an RNN, then instantiated the RNN a second time before the training
loop, so `optimizer.step()` updated the first model, which got no gradients; the fix builds the optimizer after the
model the loop trains. The rule reports the step that has nothing to update."""
import torch
import torch.nn as nn

n_letters, n_hidden, n_categories = 57, 32, 4


class RNN(nn.Module):
    def __init__(self, input_size, hidden_size, output_size):
        super().__init__()
        self.hidden_size = hidden_size
        self.i2h = nn.Linear(input_size + hidden_size, hidden_size)
        self.i2o = nn.Linear(input_size + hidden_size, output_size)
        self.softmax = nn.LogSoftmax(dim=1)

    def forward(self, input, hidden):
        combined = torch.cat((input, hidden), 1)
        return self.softmax(self.i2o(combined)), self.i2h(combined)

    def init_hidden(self):
        return torch.zeros(1, self.hidden_size)


torch.manual_seed(0)
rnn = RNN(n_letters, n_hidden, n_categories)
criterion = nn.NLLLoss()


def train(category_tensor, line_tensor):
    hidden = rnn.init_hidden()
    optimizer.zero_grad()
    for i in range(line_tensor.size()[0]):
        output, hidden = rnn(line_tensor[i], hidden)
    loss = criterion(output, category_tensor)
    loss.backward()
    optimizer.step()
    return output, loss.item()


rnn = RNN(n_letters, n_hidden, n_categories)
optimizer = torch.optim.SGD(rnn.parameters(), lr=0.005)
for _ in range(3):
    train(torch.tensor([1]), torch.randn(5, 1, n_letters))
