#!/usr/bin/env python3
"""Writes tests/fixtures/torchvision_layouts.txt: the state_dict of each torchvision ResNet that
replica builds (names and shapes, 1000 classes), one line per tensor: "ARCH NAME D0,D1,..." (a
scalar: "-"). tests/train/test_weights_interop.cpp checks that replica's export has exactly these
names and shapes, which is what load_state_dict(strict=True) asks of a file.

Run: /usr/bin/python3 tests/reference/make_torchvision_layouts.py  (Debian's python3-torchvision)
"""
import os
import torch
import torchvision

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures", "torchvision_layouts.txt")
ARCHS = ["resnet18", "resnet34", "resnet50", "resnet101", "resnet152", "wide_resnet50_2", "wide_resnet101_2",
         "resnext50_32x4d", "resnext101_32x8d"]


def main():
    lines = ["# torchvision %s state_dict layouts (tests/reference/make_torchvision_layouts.py)" % torchvision.__version__]
    with torch.no_grad():
        for arch in ARCHS:
            model = getattr(torchvision.models, arch)()
            for name, t in model.state_dict().items():
                lines.append("%s %s %s" % (arch, name, ",".join(str(d) for d in t.shape) or "-"))
    with open(OUT, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("wrote", OUT, len(lines) - 1, "tensors")


if __name__ == "__main__":
    main()
