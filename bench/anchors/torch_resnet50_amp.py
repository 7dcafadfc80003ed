# Anchor: PyTorch ResNet-50 training throughput on one GPU with automatic mixed precision and
# channels_last, the configuration NVIDIA's DeepLearningExamples recommend (cudnn.benchmark on,
# SGD with momentum, fp16 with GradScaler or bf16 without). Synthetic 224x224x3 images, 1000
# classes; each batch is copied from pinned host memory as replica's loader does, so both sides
# pay the same input copy.
#   python3 bench/anchors/torch_resnet50_amp.py --dtype fp16 --batch 256 --steps 20 --warmup 5
# Prints one line "torch resnet50 <dtype> batch <B>: <img/s> img/s" for scripts to read.
import argparse, time
import torch, torchvision

p = argparse.ArgumentParser()
p.add_argument("--dtype", choices=["fp16", "bf16", "fp32"], default="fp16")
p.add_argument("--batch", type=int, default=256)
p.add_argument("--steps", type=int, default=20)
p.add_argument("--warmup", type=int, default=5)
a = p.parse_args()

torch.backends.cudnn.benchmark = True
dev = torch.device("cuda")
model = torchvision.models.resnet50(num_classes=1000).to(dev).to(memory_format=torch.channels_last)
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-5)
amp_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": None}[a.dtype]
scaler = torch.amp.GradScaler("cuda", enabled=a.dtype == "fp16")
x_host = torch.rand(a.batch, 3, 224, 224).sub_(0.5).div_(0.25).contiguous(memory_format=torch.channels_last).pin_memory()
y_host = torch.randint(0, 1000, (a.batch,)).pin_memory()
loss_fn = torch.nn.CrossEntropyLoss()

def step():
    x = x_host.to(dev, non_blocking=True)
    y = y_host.to(dev, non_blocking=True)
    with torch.autocast("cuda", dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
        loss = loss_fn(model(x), y)
    opt.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    return loss

for _ in range(a.warmup):
    step()
torch.cuda.synchronize()
t0 = time.perf_counter()
for _ in range(a.steps):
    loss = step()
loss.item()
torch.cuda.synchronize()
dt = time.perf_counter() - t0
print(f"torch resnet50 {a.dtype} batch {a.batch}: {a.steps * a.batch / dt:.1f} img/s (loss {loss.item():.3f})", flush=True)
