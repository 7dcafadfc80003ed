#!/usr/bin/env python3
"""torchvision's augmentation policies on one thread, on the images `replica bench augment --dump`
wrote (uint8 [N, H, W, C] .npy): RandAugment(2, 9), TrivialAugmentWide(), AutoAugment(IMAGENET)
on uint8 CHW tensors (what the reference recipes feed them, before ToTensor) and
RandomErasing(p=1) on the float image. Prints images/s per policy in replica bench augment's rows.

Usage: /usr/bin/python3 bench/anchors/torch_augment.py IMAGES.npy  (Debian's python3-torchvision)
"""
import sys, time
import numpy as np
import torch
from torchvision import transforms as T


def main():
    torch.set_num_threads(1)
    torch.manual_seed(0)
    imgs = [torch.from_numpy(a).permute(2, 0, 1).contiguous() for a in np.load(sys.argv[1])]
    floats = [i.to(torch.float32) / 255 for i in imgs]
    rows = [("randaugment (2 ops, m 9)", T.RandAugment(2, 9), imgs),
            ("trivialaugment (wide)", T.TrivialAugmentWide(), imgs),
            ("autoaugment (imagenet)", T.AutoAugment(T.AutoAugmentPolicy.IMAGENET), imgs),
            ("random_erase (p 1)", T.RandomErasing(p=1.0), floats)]
    print("# torchvision %s on torch %s, %d images of %s, one thread" % (
        __import__("torchvision").__version__, torch.__version__, len(imgs), tuple(imgs[0].shape)))
    print("%-28s %12s" % ("policy", "images/s"))
    for name, t, xs in rows:
        t0, done = time.perf_counter(), 0
        while done < len(xs) or time.perf_counter() - t0 < 1.0:
            t(xs[done % len(xs)].clone() if xs is floats else xs[done % len(xs)])
            done += 1
        print("%-28s %12.1f" % (name, done / (time.perf_counter() - t0)))


if __name__ == "__main__":
    main()
