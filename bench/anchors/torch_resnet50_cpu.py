# Anchor: PyTorch CPU training throughput of ResNet-50 or ResNeXt-50 32x4d (ARCH; torchvision's
# layout: bottlenecks 3-4-6-3, stride in the 3x3, 1000 classes) on synthetic 224x224x3 images, SGD with momentum. Written out
# in plain torch so PyPI's torch alone runs it (no torchvision). Prints "... img/s=N".
#   T=threads BS=16 STEPS=5 WARMUP=1 [ARCH=resnext50_32x4d] python3 bench/anchors/torch_resnet50_cpu.py
import os, time, torch, torch.nn as nn, torch.nn.functional as F

# ARCH=resnext50_32x4d: torchvision's ResNeXt-50 (the 3x3 in 32 groups, inner width planes x 2).
ARCH = os.environ.get("ARCH", "resnet50")
GROUPS, WPG = (32, 4) if ARCH == "resnext50_32x4d" else (1, 64)

class Bottleneck(nn.Module):
    def __init__(s, cin, planes, stride):
        super().__init__()
        cout, mid = planes * 4, planes * WPG // 64 * GROUPS
        s.c1, s.b1 = nn.Conv2d(cin, mid, 1, bias=False), nn.BatchNorm2d(mid)
        s.c2, s.b2 = nn.Conv2d(mid, mid, 3, stride, 1, groups=GROUPS, bias=False), nn.BatchNorm2d(mid)
        s.c3, s.b3 = nn.Conv2d(mid, cout, 1, bias=False), nn.BatchNorm2d(cout)
        s.down = None
        if stride != 1 or cin != cout:
            s.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
    def forward(s, x):
        o = F.relu(s.b1(s.c1(x))); o = F.relu(s.b2(s.c2(o))); o = s.b3(s.c3(o))
        return F.relu(o + (x if s.down is None else s.down(x)))

class ResNet50(nn.Module):
    def __init__(s, classes=1000):
        super().__init__()
        s.stem = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(3, 2, 1))
        layers, cin = [], 64
        for i, (mid, n) in enumerate([(64, 3), (128, 4), (256, 6), (512, 3)]):
            for b in range(n):
                layers.append(Bottleneck(cin, mid, 2 if b == 0 and i > 0 else 1)); cin = mid * 4
        s.layers = nn.Sequential(*layers)
        s.fc = nn.Linear(cin, classes)
    def forward(s, x):
        return s.fc(F.adaptive_avg_pool2d(s.layers(s.stem(x)), 1).flatten(1))

threads = int(os.environ.get("T", "1")); torch.set_num_threads(threads); torch.manual_seed(0)
bs, steps, warmup = int(os.environ.get("BS", 16)), int(os.environ.get("STEPS", 5)), int(os.environ.get("WARMUP", 1))
m = ResNet50(); opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-5)
x = torch.rand(bs, 3, 224, 224).sub_(0.5).div_(0.25); y = torch.randint(0, 1000, (bs,))
m.train()
for it in range(steps + warmup):
    if it == warmup: t0 = time.time()
    loss = F.cross_entropy(m(x), y); opt.zero_grad(); loss.backward(); opt.step()
dt = time.time() - t0
print(f"torch {torch.__version__} {ARCH} threads={threads} bs={bs} steps={steps} img/s={steps*bs/dt:.2f}")
