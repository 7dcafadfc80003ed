#!/usr/bin/env python3
"""Writes the PyTorch side of the safetensors round trip (tests/train/test_weights_interop.cpp).

Run by a person with torch, torchvision and safetensors installed (CI needs none of them):

    python3 -m venv --system-site-packages venv && venv/bin/pip install safetensors
    venv/bin/python tests/reference/make_safetensors_fixtures.py tests/fixtures

For a CIFAR ResNet-20 (3 input channels, 10 classes) and a torchvision ResNet-50 at width 8 (so
the fixture stays small), it writes NAME.safetensors (the state_dict as
safetensors.torch.save_file writes it, metadata {"format": "pt"}) and NAME_io.safetensors (two
fixed input images in NHWC and the model's eval-mode logits). Batch-norm parameters and running
statistics are randomised so that the test sees a wrong mapping.
"""
import sys

import torch
import torch.nn as nn
import torchvision
from safetensors.torch import save_file
from torchvision.models.resnet import Bottleneck


class BasicBlock(nn.Module):
    """The conventional CIFAR ResNet block (pytorch-cifar's), projection shortcut ("option B")."""

    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return torch.relu(y + self.shortcut(x))


class CifarResNet(nn.Module):
    def __init__(self, n, in_channels=3, classes=10, width=16):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, width, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        c = width
        for s in range(3):
            blocks = []
            for b in range(n):
                w = width << s
                blocks.append(BasicBlock(c, w, 2 if (b == 0 and s > 0) else 1))
                c = w
            setattr(self, "layer%d" % (s + 1), nn.Sequential(*blocks))
        self.fc = nn.Linear(c, classes)

    def forward(self, x):
        x = torch.relu(self.bn1(self.conv1(x)))
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.fc(x.mean((2, 3)))


class NarrowResNet50(torchvision.models.resnet.ResNet):
    """torchvision's ResNet-50 (same module names, v1.5 strides) with base width w instead of 64."""

    def __init__(self, w, classes):
        nn.Module.__init__(self)
        self._norm_layer = nn.BatchNorm2d
        self.inplanes, self.dilation, self.groups, self.base_width = w, 1, 1, 64
        self.conv1 = nn.Conv2d(3, w, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(w)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.layer1 = self._make_layer(Bottleneck, w, 3)
        self.layer2 = self._make_layer(Bottleneck, 2 * w, 4, stride=2)
        self.layer3 = self._make_layer(Bottleneck, 4 * w, 6, stride=2)
        self.layer4 = self._make_layer(Bottleneck, 8 * w, 3, stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(8 * w * Bottleneck.expansion, classes)


def randomise_bn(model, g):
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            n = m.num_features
            m.weight.data = torch.rand(n, generator=g) + 0.5
            m.bias.data = torch.randn(n, generator=g) * 0.1
            m.running_mean = torch.randn(n, generator=g) * 0.1
            m.running_var = torch.rand(n, generator=g) + 0.5
            m.num_batches_tracked = torch.tensor(7, dtype=torch.int64)


def write(name, model, hw, out):
    g = torch.Generator().manual_seed(1)
    randomise_bn(model, g)
    model.eval()
    x = torch.randn(2, 3, hw, hw, generator=g)
    with torch.no_grad():
        logits = model(x)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, "%s/%s.safetensors" % (out, name), metadata={"format": "pt"})
    save_file({"input_nhwc": x.permute(0, 2, 3, 1).contiguous(), "logits": logits.contiguous()},
              "%s/%s_io.safetensors" % (out, name), metadata={"format": "pt"})
    print(name, sum(v.numel() for v in state.values()), "values, logits[0][:3]", logits[0][:3].tolist())


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures"
    torch.manual_seed(0)
    write("resnet20_torch", CifarResNet(3), 32, out)
    torch.manual_seed(0)
    write("resnet50w8_torch", NarrowResNet50(8, 10), 64, out)


if __name__ == "__main__":
    main()
