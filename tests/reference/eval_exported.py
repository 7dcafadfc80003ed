#!/usr/bin/env python3
"""Evaluates a model replica exported (`replica export`) in PyTorch, on Fashion-MNIST's test set.

    replica export --model RUN_DIR/model.bin RUN_DIR/model.safetensors
    venv/bin/python tests/reference/eval_exported.py RUN_DIR/model.safetensors [resnet20]

Prints the accuracy and mean loss; `replica eval --model RUN_DIR/model.bin` must print the same
accuracy (to 0.01 points). The data set is Debian's dataset-fashion-mnist; the normalisation is
the default configuration's (data.mean 0.2860, data.std 0.3530).
"""
import gzip
import struct
import sys

import numpy as np
import torch
from safetensors.torch import load_file

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from make_safetensors_fixtures import CifarResNet  # noqa: E402

DATA = "/usr/share/datasets/fashion-mnist"


def idx(path):
    with gzip.open(path, "rb") as f:
        data = f.read()
    magic = struct.unpack(">I", data[:4])[0]
    dims = [struct.unpack(">I", data[4 + 4 * i: 8 + 4 * i])[0] for i in range(magic & 0xFF)]
    return np.frombuffer(data, np.uint8, offset=4 + 4 * len(dims)).reshape(dims)


def main():
    path = sys.argv[1]
    depth = {"resnet20": 3, "resnet32": 5, "resnet56": 9, "resnet110": 18}[sys.argv[2] if len(sys.argv) > 2 else "resnet20"]
    model = CifarResNet(depth, in_channels=1, classes=10)
    model.load_state_dict(load_file(path), strict=True)  # every name and shape must match
    model.eval()
    x = torch.from_numpy(idx(DATA + "/t10k-images-idx3-ubyte.gz").astype(np.float32) / 255.0)
    x = ((x - 0.2860) / 0.3530).unsqueeze(1)
    y = torch.from_numpy(idx(DATA + "/t10k-labels-idx1-ubyte.gz").astype(np.int64))
    correct, loss = 0, 0.0
    with torch.no_grad():
        for i in range(0, len(y), 500):
            logits = model(x[i:i + 500])
            loss += torch.nn.functional.cross_entropy(logits, y[i:i + 500], reduction="sum").item()
            correct += (logits.argmax(1) == y[i:i + 500]).sum().item()
    print("PyTorch %s on fashion-mnist: test loss %.4f accuracy %.2f%% (%d images)"
          % (path, loss / len(y), 100.0 * correct / len(y), len(y)))


if __name__ == "__main__":
    main()
