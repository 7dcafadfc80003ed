#!/usr/bin/env python3
"""Writes the seed corpora of the fuzz targets (tests/fuzz/corpus/<target>/): small valid files of
every format replica reads, so libFuzzer starts from inputs that pass the magic and the checksum.
Run: python3 tests/fuzz/make_corpus.py (stdlib only). The configs/*.yaml seeds are copied too."""
import glob, gzip, os, shutil, struct

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..")


def fnv1a(b, h=14695981039346656037):
    for x in b:
        h = ((h ^ x) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return h


def out(target, name, data):
    d = os.path.join(HERE, "corpus", target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


def checkpoint(sections, version=2, basis=14695981039346656037):
    b = b"RPLCKPT\0" + struct.pack("<II", version, len(sections))
    for name, payload in sorted(sections.items()):
        b += struct.pack("<I", len(name)) + name + struct.pack("<QQ", len(payload), fnv1a(payload, basis)) + payload
    return b


meta = b"arch=resnet20\nepoch=0\nglobal_batch=32\nglobal_step=3\nnum_buffers=4\nnum_params=6\n" \
       b"optimizer=sgd\noptimizer_steps=3\nprecision=fp32\nseed=0\nstep_in_epoch=3\nworld=2\n"
secs = {b"config": b"model:\n  arch: resnet20\n", b"meta": meta, b"params": struct.pack("<6f", *range(6)),
        b"buffers.0": struct.pack("<4f", 0, 0, 1, 1), b"buffers.1": struct.pack("<4f", 0, 0, 1, 1),
        b"optimizer": struct.pack("<6f", *([0.5] * 6)), b"scaler": struct.pack("<f4xqqqi4x", 65536.0, 1, 0, 0, 1)}
out("fuzz_checkpoint", "v2", checkpoint(secs))
out("fuzz_checkpoint", "v1_legacy", checkpoint(secs, 1, 1469598103934665603))
out("fuzz_checkpoint", "minimal", checkpoint({k: secs[k] for k in (b"config", b"meta", b"params")}))

def model(np_, nb, magic=b"RPLM0002"):
    b = magic + struct.pack("<I", 8) + b"resnet20" + struct.pack("<qq", np_, nb)
    b += struct.pack("<%df" % (np_ + nb), *[0.25 * i for i in range(np_ + nb)])
    return b + struct.pack("<Q", fnv1a(b, 14695981039346656037 if magic == b"RPLM0002" else 1469598103934665603))
out("fuzz_model_file", "small", model(6, 4))
out("fuzz_model_file", "legacy", model(3, 2, b"RPLM0001"))
out("fuzz_model_file", "empty_weights", model(0, 0))

images = b"\0\0\x08\x03" + struct.pack(">III", 3, 4, 4) + bytes(range(48))
labels = b"\0\0\x08\x01" + struct.pack(">I", 3) + bytes([1, 2, 3])
out("fuzz_idx", "images", images)
out("fuzz_idx", "labels", labels)
out("fuzz_idx", "images.gz", gzip.compress(images, mtime=0))

out("fuzz_cifar", "two_records", bytes([3]) + bytes(range(256)) * 12 + bytes([9]) + bytes(3072))

def safetensors(header, data):
    h = header.encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    return struct.pack("<Q", len(h)) + h + data


out("fuzz_safetensors", "two", safetensors(
    '{"__metadata__":{"format":"pt"},"bn.num_batches_tracked":{"dtype":"I64","shape":[],"data_offsets":[0,8]},'
    '"conv.weight":{"dtype":"F32","shape":[2,1,1,1],"data_offsets":[8,16]}}', struct.pack("<q2f", 7, 1.0, -2.0)))
out("fuzz_safetensors", "half", safetensors(
    '{"a":{"dtype":"BF16","shape":[2],"data_offsets":[0,4]},"b\\u00e9":{"dtype":"F16","shape":[1],"data_offsets":[4,6]}}',
    b"\x80\x3f\x00\x40\x00\x3c"))
out("fuzz_safetensors", "empty", safetensors("{}", b""))

def png(w, h, rows):
    import zlib
    def chunk(t, d):
        return struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d) & 0xFFFFFFFF)
    raw = b"".join(b"\0" + r for r in rows)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)) +
            chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))


small_png = png(3, 2, [bytes(range(9)), bytes(range(9, 18))])
out("fuzz_image", "rgb.png", small_png)
# fuzz_image/*.jpg seeds are JPEGs written by `replica pack --idx` (this script has no encoder).


def pack(classes, blobs):
    head = b"RPLPACK1" + struct.pack("<IIQ", 1, len(classes), len(blobs))
    names = b"".join(struct.pack("<I", len(c)) + c for c in classes)
    start = len(head) + 16 + len(names)
    index, at = b"", start
    for label, blob in blobs:
        index += struct.pack("<QIiHH", at, len(blob), label, 3, 2)
        at += len(blob)
    return head + struct.pack("<QQ", at, fnv1a(index)) + names + b"".join(b for _, b in blobs) + index


out("fuzz_pack", "two", pack([b"a", b"b"], [(0, small_png), (1, small_png)]))

for p in sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml"))):
    name = os.path.basename(p)
    with open(p, "rb") as f:
        out("fuzz_config", name, b"train.epochs=2\n" + f.read())
out("fuzz_config", "set_list", b"data.mean=[0.5, 0.5]\nmemory:\n  bytes: 2GiB\n")
print("corpus written under", os.path.join(HERE, "corpus"))
