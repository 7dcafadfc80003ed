#!/usr/bin/env python3
"""The anchor of `replica bench data`: torchvision's ImageFolder + DataLoader with the same
transforms (RandomResizedCrop(size), RandomHorizontalFlip, ToTensor, Normalize), images/s of the
input pipeline alone (no model), per worker count. Run by bench/compare_data.sh beside replica.

    python3 bench/anchors/torch_data.py DIR/train --size 224 --images 2048 --workers 1 2
"""
import argparse
import time

import torch
import torchvision.transforms as T
from torchvision.datasets import ImageFolder


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("root")
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--images", type=int, default=2048)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--batch", type=int, default=32)
    a = ap.parse_args()
    torch.set_num_threads(1)
    tf = T.Compose([T.RandomResizedCrop(a.size), T.RandomHorizontalFlip(), T.ToTensor(),
                    T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
    ds = ImageFolder(a.root, transform=tf)
    n = min(a.images, len(ds))
    sub = torch.utils.data.Subset(ds, list(range(0, len(ds), max(1, len(ds) // n)))[:n])
    print("# torchvision ImageFolder + DataLoader, %d images to %dx%d (RandomResizedCrop + flip), torch %s"
          % (n, a.size, a.size, torch.__version__))
    print("%8s %12s %14s" % ("workers", "images/s", "per worker"))
    for w in a.workers:
        dl = torch.utils.data.DataLoader(sub, batch_size=a.batch, shuffle=True, num_workers=w,
                                         persistent_workers=False, prefetch_factor=2)
        it = iter(dl)
        next(it)  # worker start-up is not the pipeline's speed
        t0, seen = time.perf_counter(), 0
        for x, _ in it:
            seen += x.shape[0]
        dt = time.perf_counter() - t0
        print("%8d %12.1f %14.1f" % (w, seen / dt, seen / dt / w))


if __name__ == "__main__":
    main()
