#!/usr/bin/env python3
"""Writes the torchvision golden fixture of the augmentation ops for tests/data/test_augment.cpp:
each op of torchvision.transforms.autoaugment._apply_op (the ops of AutoAugment, RandAugment and
TrivialAugmentWide) at several magnitudes, signed where the policies draw a sign, on a fixed
uint8 image of 3 channels (23 x 29) and of 1 channel (17 x 12), and torchvision's magnitude bins.

Run: /usr/bin/python3 tests/reference/make_augment_fixtures.py  (Debian's python3-torch and
python3-torchvision 0.14.1)
Format: tests/reference/make_reference.py's (tests/reference/fixture_io.py).
"""
import math, os, struct
import numpy as np
import torch
import torchvision
from torchvision.transforms import autoaugment as A, InterpolationMode

import sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fixture_io import write_fixture  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures", "augment_golden.bin")

# (op, magnitudes) with the units _apply_op takes; the C++ test names the same list.
OPS = [
    ("ShearX", [0.3, -0.17, 0.99]), ("ShearY", [0.21, -0.3]), ("TranslateX", [5.0, -13.6]),
    ("TranslateY", [3.0, -7.9]), ("Rotate", [30.0, -13.0, 135.0]), ("Brightness", [0.9, -0.5]),
    ("Color", [0.9, -0.66]), ("Contrast", [0.8, -0.42]), ("Sharpness", [0.9, -0.9]), ("Posterize", [4.0, 7.0, 2.0]),
    ("Solarize", [128.0, 30.0]), ("AutoContrast", [0.0]), ("Equalize", [0.0]), ("Invert", [0.0]),
]


def image(c, h, w, seed):
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(0, 256, (c, h, w), generator=g, dtype=torch.int64)
    ramp = (torch.arange(h)[:, None] * 7 + torch.arange(w)[None, :] * 3)  # some structure for the geometry
    # narrow the range so that autocontrast and equalize have work to do
    return ((base // 3 + ramp[None] % 90) + 20).clamp(0, 255).to(torch.uint8)


def main():
    out = {}
    imgs = {"c3": image(3, 23, 29, 1), "c1": image(1, 17, 12, 2)}
    for tag, img in imgs.items():
        out["img_" + tag] = img.permute(1, 2, 0).to(torch.float32)  # HWC
        for op, mags in OPS:
            for k, m in enumerate(mags):
                m = float(np.float32(m))  # the policies' magnitudes are f32 bins (torch.linspace)
                y = A._apply_op(img, op, m, interpolation=InterpolationMode.NEAREST, fill=None)
                out["%s_%d_%s" % (op, k, tag)] = y.permute(1, 2, 0).to(torch.float32)
    # The magnitude bins of RandAugment (31) and AutoAugment (10) for a 23 x 29 image, and of
    # TrivialAugmentWide (31): op order as each class lists them.
    for name, space in (("ra", A.RandAugment()._augmentation_space(31, (23, 29))),
                        ("aa", A.AutoAugment()._augmentation_space(10, (23, 29))),
                        ("ta", A.TrivialAugmentWide()._augmentation_space(31))):
        for op, (mags, signed) in space.items():
            if mags.ndim > 0:
                out["bins_%s_%s" % (name, op)] = mags.to(torch.float32)
    write_fixture(OUT, out)
    print("wrote", OUT, "with", len(out), "tensors; torch", torch.__version__, "torchvision", torchvision.__version__)


if __name__ == "__main__":
    main()
