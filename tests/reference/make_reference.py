#!/usr/bin/env python3
"""Writes the PyTorch golden fixture for tests/ops/test_golden.cpp.

The model is the anchor ResNet-20 of bench/anchors/torch_resnet.py (option-B shortcuts, width
16, 1 input channel, 10 classes), imported from there. On the first 8 Fashion-MNIST test images it records: inputs
(NHWC), labels, every parameter (in replica's layouts: conv KRSC), the logits and mean
cross-entropy loss of one training-mode forward pass, every gradient, the BN running statistics
after that pass, the logits of an eval-mode forward pass with those statistics (moved off their
(0, 1) start by that pass, so a mistake in eval-mode normalisation shows), and the losses of 3 SGD steps (lr 0.02, momentum 0.9, Nesterov, weight decay 5e-4
coupled, as torch.optim.SGD) on the same batch.

Run: /usr/bin/python3 tests/reference/make_reference.py  (Debian's python3-torch)
Format (little-endian): b"RPLG0001", u32 count, then per tensor: u32 name length, name bytes,
u32 rank, rank x i64 dims, float32 data.
"""
import copy, os, struct, sys
import numpy as np
import torch, torch.nn.functional as F

# The model and the IDX reader are the anchor's own (bench/anchors/torch_resnet.py), so the
# fixture tests exactly the network the benchmarks compare against.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench", "anchors"))
from torch_resnet import ResNet, load as load_idx  # noqa: E402

torch.manual_seed(0)
torch.set_num_threads(1)
D = "/usr/share/datasets/fashion-mnist/"
SGD_LR = 0.02  # at 0.1 a batch of 8 makes the trajectory chaotic (f32 and f64 differ by 2% in 3 steps)
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures", "resnet20_golden.bin")


def to_replica(t):
    t = t.detach().float()
    if t.dim() == 4:  # NCHW / KCRS -> NHWC / KRSC
        t = t.permute(0, 2, 3, 1)
    return t.contiguous().numpy()


def main():
    X = torch.tensor(load_idx(D + "t10k-images-idx3-ubyte.gz")[:8], dtype=torch.float32).div_(255).sub_(0.2860).div_(0.3530)
    Y = torch.tensor(load_idx(D + "t10k-labels-idx1-ubyte.gz")[:8].astype(np.int64))
    m = ResNet(); m.train()
    out = []
    add = lambda name, arr: out.append((name, np.ascontiguousarray(arr, dtype=np.float32)))
    add("input", to_replica(X)); add("labels", Y.numpy().astype(np.float32))
    params = list(m.named_parameters())
    for n, p in params:
        add("param." + n, to_replica(p))
    logits = m(X); loss = F.cross_entropy(logits, Y); loss.backward()
    add("logits", logits.detach().numpy()); add("loss", np.array([loss.item()]))
    for n, p in params:
        add("grad." + n, to_replica(p.grad))
    bufs = [(n, b) for n, b in m.named_buffers() if "running" in n]
    for n, b in bufs:
        add("buffer." + n, b.detach().numpy())
    # Eval mode: normalised by the running statistics just recorded (the same weights).
    m.eval()
    with torch.no_grad():
        add("eval_logits", m(X).numpy())
    m.train()
    # 3 SGD steps from the same weights (running statistics do not affect training-mode output),
    # in float32 and again in float64: their spread is how sensitive the trajectory is to rounding,
    # which sets the C++ test's tolerance.
    for dt, name in [(torch.float32, "sgd_losses"), (torch.float64, "sgd_losses_f64")]:
        opt_model = copy.deepcopy(m).to(dt)
        opt = torch.optim.SGD(opt_model.parameters(), lr=SGD_LR, momentum=0.9, nesterov=True, weight_decay=5e-4)
        losses = []
        for _ in range(3):
            l = F.cross_entropy(opt_model(X.to(dt)), Y); opt.zero_grad(); l.backward(); opt.step(); losses.append(l.item())
        losses.append(F.cross_entropy(opt_model(X.to(dt)), Y).item())
        add(name, np.array(losses))
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT + ".tmp", "wb") as f:
        f.write(b"RPLG0001"); f.write(struct.pack("<I", len(out)))
        for name, arr in out:
            nb = name.encode(); f.write(struct.pack("<I", len(nb))); f.write(nb)
            f.write(struct.pack("<I", arr.ndim)); f.write(struct.pack("<%dq" % arr.ndim, *arr.shape))
            f.write(arr.astype("<f4").tobytes())
    os.replace(OUT + ".tmp", OUT)
    print(f"wrote {OUT}: {len(out)} tensors, loss {loss.item():.6f}")


if __name__ == "__main__":
    main()
