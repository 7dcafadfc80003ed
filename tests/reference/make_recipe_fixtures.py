#!/usr/bin/env python3
"""Writes the PyTorch golden fixture of the training recipes for tests/ops/test_recipes.cpp:

- label smoothing: torch.nn.functional.cross_entropy(label_smoothing=eps) on fixed logits [N, K]
  (f32, including rows whose label is not the argmax and one with a tie), its mean loss and the
  gradient of that mean with respect to the logits, for eps 0, 0.1 and 0.3;
- top-5: for each row, whether the label is among torch.topk(logits, 5) (ties resolved as the
  first index wins, which torch.topk on CPU does for these rows: the fixture has no tie at the
  fifth place);
- one update of the weights' moving average: torch.optim.swa_utils.AveragedModel with
  torchvision's ExponentialMovingAverage rule (decay * avg + (1 - decay) * param), decay 0.9;
- the poly schedule: torch.optim.lr_scheduler.PolynomialLR(total_iters=T, power=p) for p = 1, 2,
  with and without linear warm-up (LinearLR then PolynomialLR, SequentialLR), one lr per step;
- mixup and cutmix in pairs: the soft target's loss and gradient (F.cross_entropy with
  probability targets, e = 0 and 0.1) for given weights, and two images mixed both ways by mixup
  (lambda * a + (1 - lambda) * b) and by cutmix (a box exchanged).

Run: /usr/bin/python3 tests/reference/make_recipe_fixtures.py  (Debian's python3-torch)
Format: tests/reference/make_reference.py's (tests/reference/fixture_io.py).
"""
import os, struct
import numpy as np
import torch
import torch.nn.functional as F

import sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fixture_io import write_fixture  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures", "recipes_golden.bin")


def main():
    torch.manual_seed(0)
    out = {}
    N, K = 12, 10
    z = torch.randn(N, K, dtype=torch.float32) * 3
    labels = torch.randint(0, K, (N,))
    z[3, 7] = z[3].max() + 1.0   # a row whose label is surely not the argmax below
    labels[3] = 2
    z[5, 4] = z[5, 1] = z[5].max() + 0.5  # a tie for the first place
    labels[5] = 4
    out["logits"] = z.clone()
    out["labels"] = labels.to(torch.float32)
    for eps in (0.0, 0.1, 0.3):
        zz = z.clone().requires_grad_(True)
        loss = F.cross_entropy(zz, labels, label_smoothing=eps)
        loss.backward()
        tag = "%g" % eps
        out["loss_eps" + tag] = loss.detach().reshape(1)
        out["grad_eps" + tag] = zz.grad.detach()
    top5 = torch.topk(z, 5, dim=1).indices
    out["top5_hit"] = (top5 == labels[:, None]).any(dim=1).to(torch.float32)
    out["top1_hit"] = (z.argmax(dim=1) == labels).to(torch.float32)
    T, base = 20, 2.0
    for power in (1.0, 2.0):
        opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=base)
        sched = torch.optim.lr_scheduler.PolynomialLR(opt, total_iters=T, power=power)
        lrs = []
        for _ in range(T + 3):
            lrs.append(opt.param_groups[0]["lr"])
            opt.step(); sched.step()
        out["poly_p%g" % power] = torch.tensor(lrs, dtype=torch.float32)
    # Warm-up 5 steps (LinearLR from 0.1 of the lr), then PolynomialLR over the remaining 15.
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=base)
    warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, end_factor=1.0, total_iters=5)
    poly = torch.optim.lr_scheduler.PolynomialLR(opt, total_iters=15, power=2.0)
    seq = torch.optim.lr_scheduler.SequentialLR(opt, [warm, poly], milestones=[5])
    lrs = []
    for _ in range(T + 3):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step(); seq.step()
    out["poly_p2_warmup5"] = torch.tensor(lrs, dtype=torch.float32)
    # The moving average: an AveragedModel of a Linear(8, 8) whose average holds `ema_before`, one
    # update_parameters with the model at `ema_param`.
    decay = 0.9
    lin = torch.nn.Linear(8, 8)
    avg = torch.optim.swa_utils.AveragedModel(lin, avg_fn=lambda a, p, n: decay * a + (1 - decay) * p)
    with torch.no_grad():
        before = torch.randn(8, 8)
        avg.module.weight.copy_(before)
        avg.n_averaged.fill_(1)  # past the first update, which copies
        lin.weight.copy_(torch.randn(8, 8))
    avg.update_parameters(lin)
    out["ema_before"] = before.reshape(-1)
    out["ema_param"] = lin.weight.detach().reshape(-1).clone()
    out["ema_after"] = avg.module.weight.detach().reshape(-1).clone()
    # Mixup / cutmix in pairs (data/mixing.h): rows 2k and 2k+1 mix with one weight w_k of their own
    # label (a multiple of 2^-24, as replica carries it), the target w onehot(y_n) + (1 - w)
    # onehot(y_(n^1)) as torchvision's v2.MixUp builds it (one_hot, then lam * t + (1 - lam) * rolled),
    # and F.cross_entropy with probability targets, smoothed or not.
    q = torch.tensor([16777216, 8388608, 3355443, 12582912, 0, 10000000], dtype=torch.int64)  # 1, 1/2, ~0.2, 3/4, 0, ~0.6
    w = (q.to(torch.float64) / 2**24).repeat_interleave(2)
    partner = torch.arange(N) ^ 1
    onehot = F.one_hot(labels, K).to(torch.float64)
    soft = (w[:, None] * onehot + (1 - w[:, None]) * onehot[partner]).to(torch.float32)
    out["mix_weight_q"] = q.to(torch.float32)
    for eps in (0.0, 0.1):
        zz = z.clone().requires_grad_(True)
        loss = F.cross_entropy(zz, soft, label_smoothing=eps)
        loss.backward()
        tag = "%g" % eps
        out["mix_loss_eps" + tag] = loss.detach().reshape(1)
        out["mix_grad_eps" + tag] = zz.grad.detach()
    # The images: two 6x5x3 samples, mixup with lambda 0.3 (2^-24 multiple) both ways, and cutmix's
    # box rows [1, 4) x columns [2, 5) exchanged, with its lambda 1 - 9/30.
    a, b = torch.rand(6, 5, 3), torch.rand(6, 5, 3)
    lam = 5033165 / 2**24
    out["mix_a"], out["mix_b"] = a.clone(), b.clone()
    out["mixup_a"] = lam * a + (1 - lam) * b
    out["mixup_b"] = lam * b + (1 - lam) * a
    ca, cb = a.clone(), b.clone()
    ca[1:4, 2:5, :] = b[1:4, 2:5, :]
    cb[1:4, 2:5, :] = a[1:4, 2:5, :]
    out["cutmix_a"], out["cutmix_b"] = ca, cb
    write_fixture(OUT, out)
    print("wrote", OUT, "with", ", ".join(out))
    print("torch", torch.__version__, "poly p2 warm-up:", [round(x, 5) for x in out["poly_p2_warmup5"].tolist()])


if __name__ == "__main__":
    main()
