"""04_simplenet.py - lesson 04: the tutorials' SimpleNet in PyTorch, beside 04_simplenet.c.

The tutorial's network and hyperparameters (784-128-10 with ReLU, SGD lr 0.01 without momentum,
batch 64, 5 epochs, cross-entropy, ToTensor()'s x / 255), on Fashion-MNIST read from the same IDX
files as the C program (torchvision is not needed). It prints the mean training loss of each epoch
and the test accuracy, in the C program's format.

Run:  python3 examples/course/04_simplenet.py [DATA] [--init FILE] [--mgpu-order]
  DATA          the folder of the Fashion-MNIST IDX files [/usr/share/datasets/fashion-mnist]
  --init FILE   start from these weights (04_simplenet --save-init FILE writes them) instead of
                PyTorch's own random ones
  --mgpu-order  take the batches in the order of mgpu's loader (shuffle seed 1), not DataLoader's
With both, the two programs compute the same thing and differ by float rounding only
(tests/course_simplenet.sh checks it).
"""
import gzip
import os
import sys

import numpy as np
import torch
import torch.nn as nn
import torch.optim as optim


class SimpleNet(nn.Module):   # the tutorial's, as it is
    def __init__(self):
        super(SimpleNet, self).__init__()
        self.fc1 = nn.Linear(28 * 28, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = x.view(-1, 28 * 28)
        x = torch.relu(self.fc1(x))
        x = self.fc2(x)
        return x


def idx(folder, name, offset):
    """An IDX file's bytes after its header (offset 16 for images, 8 for labels)."""
    path = os.path.join(folder, name)
    if os.path.exists(path + ".gz"):   # Debian's files are gzipped
        with gzip.open(path + ".gz", "rb") as f:
            return np.frombuffer(f.read(), dtype=np.uint8)[offset:]
    with open(path, "rb") as f:
        return np.frombuffer(f.read(), dtype=np.uint8)[offset:]


def load(folder, split):
    """ToTensor(): uint8 pixels to float32 in [0, 1], shape [N, 1, 28, 28]; labels as int64."""
    x = torch.from_numpy(idx(folder, split + "-images-idx3-ubyte", 16).reshape(-1, 1, 28, 28).copy())
    y = torch.from_numpy(idx(folder, split + "-labels-idx1-ubyte", 8).astype(np.int64))
    return x.float().div(255), y


M64 = (1 << 64) - 1


def mix(x):
    """splitmix64's finaliser, as mgpu.h's mgpu__mix."""
    x = (x + 0x9E3779B97F4A7C15) & M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def mgpu_order(n, seed, epoch):
    """mgpu_loader_start's shuffle: Fisher-Yates from the end, j = state % (i + 1), the state
    mixed once per swap, starting from mix(seed ^ mix(epoch))."""
    order = list(range(n))
    state = mix(seed ^ mix(epoch))
    for i in range(n - 1, 0, -1):
        state = mix(state)
        j = state % (i + 1)
        order[i], order[j] = order[j], order[i]
    return torch.tensor(order)


def main():
    args = sys.argv[1:]
    folder, init, same_order = "/usr/share/datasets/fashion-mnist", None, False
    while args:
        a = args.pop(0)
        if a == "--init" and args:
            init = args.pop(0)
        elif a == "--mgpu-order":
            same_order = True
        elif not a.startswith("-"):
            folder = a
        else:
            sys.exit("usage: 04_simplenet.py [DATA] [--init FILE] [--mgpu-order]")

    torch.manual_seed(1)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    train_x, train_y = load(folder, "train")
    test_x, test_y = load(folder, "t10k")

    model = SimpleNet()
    if init:   # mgpu's names are nn.Sequential's: 1.* is fc1, 3.* is fc2
        from safetensors.torch import load_file
        w = load_file(init)
        model.load_state_dict({"fc1.weight": w["1.weight"], "fc1.bias": w["1.bias"],
                               "fc2.weight": w["3.weight"], "fc2.bias": w["3.bias"]})
    model = model.to(device)
    criterion = nn.CrossEntropyLoss()
    optimizer = optim.SGD(model.parameters(), lr=0.01)
    train_loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(train_x, train_y), batch_size=64, shuffle=True)

    print("SimpleNet 784-128-10 on %s: SGD lr 0.01, batch 64, 5 epochs" % device)
    for epoch in range(5):
        if same_order:   # mgpu's batches: the same rows, in the same order
            order = mgpu_order(len(train_x), 1, epoch)
            batches = ((train_x[b], train_y[b]) for b in order.split(64))
        else:
            batches = train_loader
        running_loss, count = 0.0, 0
        for data, target in batches:
            data, target = data.to(device), target.to(device)

            optimizer.zero_grad()
            output = model(data)
            loss = criterion(output, target)
            loss.backward()
            optimizer.step()
            running_loss += loss.item()
            count += 1
        print("epoch %d: mean training loss %.6f" % (epoch + 1, running_loss / count))

    with torch.no_grad():
        correct = (model(test_x.to(device)).argmax(1) == test_y.to(device)).sum().item()
    print("test accuracy %.4f (%d images)" % (correct / len(test_y), len(test_y)))


if __name__ == "__main__":
    main()
