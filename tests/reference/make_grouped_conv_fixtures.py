#!/usr/bin/env python3
"""Writes the PyTorch golden fixture of grouped convolution for tests/ops/test_grouped_conv.cpp:
for several group counts, strides, kernel sizes and channel counts, the input x (NHWC), the filter
w (KRSC, C / groups channels), torch.nn.functional.conv2d's output y (NHWC) and, for a fixed
output gradient dy (NHWC), autograd's input gradient dx (NHWC) and weight gradient dw (KRSC), in
float64 then stored as f32.

Run: /usr/bin/python3 tests/reference/make_grouped_conv_fixtures.py  (Debian's python3-torch)
Format: tests/reference/make_reference.py's (tests/reference/fixture_io.py).
"""
import os, struct
import numpy as np
import torch
import torch.nn.functional as F

import sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fixture_io import write_fixture  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures", "grouped_conv_golden.bin")
# name: N, H, W, C, K, R, stride, pad, groups (the C++ test lists the same)
CASES = {
    "g4_s1": (2, 7, 6, 8, 12, 3, 1, 1, 4),
    "g8_s2": (2, 9, 9, 16, 16, 3, 2, 1, 8),
    "g2_c3": (1, 5, 7, 6, 6, 3, 1, 1, 2),
    "g16_c4_s2": (2, 6, 6, 64, 64, 3, 2, 1, 16),
    "g32_depthwise": (2, 5, 5, 32, 32, 3, 1, 1, 32),
    "g2_1x1": (2, 5, 5, 8, 16, 1, 1, 0, 2),
}


def main():
    torch.manual_seed(0)
    out = {}
    for name, (N, H, W, C, K, R, stride, pad, groups) in CASES.items():
        x = torch.randn(N, C, H, W, dtype=torch.float64, requires_grad=True)
        w = (torch.randn(K, C // groups, R, R, dtype=torch.float64) * 0.3).requires_grad_(True)
        y = F.conv2d(x, w, stride=stride, padding=pad, groups=groups)
        dy = torch.randn_like(y)
        y.backward(dy)
        nhwc = lambda t: t.detach().permute(0, 2, 3, 1).contiguous().to(torch.float32)
        out[name + "_x"] = nhwc(x)
        out[name + "_w"] = w.detach().permute(0, 2, 3, 1).contiguous().to(torch.float32)
        out[name + "_y"] = nhwc(y)
        out[name + "_dy"] = nhwc(dy)
        out[name + "_dx"] = nhwc(x.grad)
        out[name + "_dw"] = w.grad.detach().permute(0, 2, 3, 1).contiguous().to(torch.float32)
    write_fixture(OUT, out)
    print("wrote", OUT, "with", len(out), "tensors; torch", torch.__version__)


if __name__ == "__main__":
    main()
