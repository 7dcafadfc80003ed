#!/usr/bin/env python3
"""Checks a model replica exported (`replica export`) against torchvision's model of the same name:
loads the safetensors with load_state_dict(strict=True) and compares its eval-mode class
probabilities on image files with those `replica predict --json --top K` printed for them.

    replica export --model RUN/model.bin RUN/model.safetensors
    replica predict RUN/model.bin IMAGES... --json --top K > RUN/predict.jsonl
    /usr/bin/python3 tests/reference/check_export_torchvision.py RUN/model.safetensors RUN/predict.jsonl ARCH \
        --mean 0.5 0.5 0.5 --std 0.25 0.25 0.25

The other direction: `--write-torchvision ARCH CLASSES OUT.safetensors` writes a torchvision model
with random weights for `replica import`; predicting with the imported model and checking it
against OUT.safetensors as above closes the loop.

The images must be of the model's input size (predict reads them as they are; this script does no
resizing). Prints the largest probability difference and whether the top-1 classes agree. Reads
safetensors itself (no safetensors package needed). Debian's python3-torch, python3-torchvision.
"""
import argparse, json, struct, sys
import numpy as np
import torch
import torchvision
from PIL import Image

DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": None, "I64": np.int64}


def load_safetensors(path):
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    base = 8 + n
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        a, b = meta["data_offsets"]
        arr = np.frombuffer(raw[base + a:base + b], dtype=DTYPES[meta["dtype"]]).reshape(meta["shape"])
        out[name] = torch.from_numpy(arr.copy())
    return out


def save_safetensors(sd, path):
    """torchvision's state_dict as safetensors.torch.save_file writes it (F32 / I64, metadata pt)."""
    header, blobs, off = {"__metadata__": {"format": "pt"}}, [], 0
    for name, t in sd.items():
        arr = t.detach().contiguous().numpy()
        dt = "I64" if arr.dtype == np.int64 else "F32"
        b = arr.astype(np.int64 if dt == "I64" else np.float32).tobytes()
        header[name] = {"dtype": dt, "shape": list(arr.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b); off += len(b)
    h = json.dumps(header).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h))); f.write(h)
        for b in blobs: f.write(b)


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--write-torchvision":
        # --write-torchvision ARCH CLASSES OUT.safetensors: a torchvision model with random weights and
        # batch-norm statistics, for `replica import` (the other direction of the check).
        arch, classes, out = sys.argv[2], int(sys.argv[3]), sys.argv[4]
        torch.manual_seed(0)
        m = getattr(torchvision.models, arch)(num_classes=classes)
        with torch.no_grad():
            for mod in m.modules():
                if isinstance(mod, torch.nn.BatchNorm2d):
                    mod.running_mean.uniform_(-0.1, 0.1); mod.running_var.uniform_(0.5, 1.5)
                    mod.weight.uniform_(0.3, 0.7); mod.bias.uniform_(-0.1, 0.1)
        save_safetensors(m.state_dict(), out)
        print("wrote", out)
        return 0
    ap = argparse.ArgumentParser()
    ap.add_argument("weights"); ap.add_argument("predictions"); ap.add_argument("arch")
    ap.add_argument("--mean", type=float, nargs="+", required=True); ap.add_argument("--std", type=float, nargs="+", required=True)
    a = ap.parse_args()
    sd = load_safetensors(a.weights)
    classes = sd["fc.weight"].shape[0]
    model = getattr(torchvision.models, a.arch)(num_classes=classes)
    model.load_state_dict(sd, strict=True)  # raises on any missing, unexpected or misshapen tensor
    model.eval()
    worst, agree, n = 0.0, 0, 0
    for line in open(a.predictions):
        if not line.startswith("{"):
            continue
        p = json.loads(line)
        img = np.asarray(Image.open(p["file"]).convert("RGB"), dtype=np.float32) / 255.0
        x = (torch.from_numpy(img) - torch.tensor(a.mean)) / torch.tensor(a.std)
        with torch.no_grad():
            probs = torch.softmax(model(x.permute(2, 0, 1)[None].double() if False else x.permute(2, 0, 1)[None]), 1)[0]
        for t in p["top"]:
            worst = max(worst, abs(float(probs[t["index"]]) - t["probability"]))
        agree += int(probs.argmax()) == p["top"][0]["index"]
        n += 1
    print("%s: strict load ok (%d tensors); %d images: top-1 agrees on %d, largest probability difference %.2e"
          % (a.arch, len(sd), n, agree, worst))
    return 0 if n and agree == n else 1


if __name__ == "__main__":
    sys.exit(main())
