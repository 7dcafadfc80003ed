"""The golden fixtures' file format, written in one place for every make_*_fixtures.py script and
read by tests/support/fixture.h: little-endian b"RPLG0001", u32 count, then per tensor u32 name
length, the name, u32 rank, i64 dims, f32 data. Written to a temporary file and renamed, so a
failed run leaves the old fixture whole."""
import os, struct
import numpy as np


def write_fixture(path, tensors):
    """tensors: name -> torch tensor or numpy array (any float or int dtype; stored as f32), in order."""
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(b"RPLG0001"); f.write(struct.pack("<I", len(tensors)))
        for name, t in tensors.items():
            arr = t.detach().numpy() if hasattr(t, "detach") else np.asarray(t)
            arr = np.ascontiguousarray(arr.astype("<f4"))
            nb = name.encode(); f.write(struct.pack("<I", len(nb))); f.write(nb)
            f.write(struct.pack("<I", arr.ndim)); f.write(struct.pack("<%dq" % arr.ndim, *arr.shape))
            f.write(arr.tobytes())
    os.replace(tmp, path)
