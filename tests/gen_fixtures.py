"""Writes safetensors fixtures with the reference Python implementation, for test_io.c.

fixtures/py.safetensors  a file written by safetensors.numpy.save_file
fixtures/py.expected     what the header holds, one tensor per line:
                         T name dtype ndim dims... begin end byte_sum
                         M key value          (metadata; no spaces in either)
"""
import json
import os
import struct
import sys

import numpy as np
from safetensors.numpy import save_file

out = sys.argv[1] if len(sys.argv) > 1 else "fixtures"
os.makedirs(out, exist_ok=True)
tensors = {
    "arange": np.arange(6, dtype=np.float32).reshape(2, 3),
    "ints": np.array([-1, 0, 1, 2], dtype=np.int32),
    "bytes": np.arange(10, dtype=np.uint8).reshape(5, 1, 2),
    "scalar": np.array(3.25, dtype=np.float64),
    "half": np.array([1.0, -2.0, 0.5], dtype=np.float16),
    "longs": np.array([[1, 2], [3, 4]], dtype=np.int64),
    "flags": np.array([True, False, True]),
    "empty": np.zeros((0, 4), dtype=np.float32),
    "layer.0.weight": np.linspace(-1, 1, 24, dtype=np.float32).reshape(4, 6),
}
meta = {"format": "np", "author": "gen_fixtures.py"}
path = os.path.join(out, "py.safetensors")
save_file(tensors, path, metadata=meta)

raw = open(path, "rb").read()
n = struct.unpack("<Q", raw[:8])[0]
header = json.loads(raw[8:8 + n])  # dict keeps the file order
data = raw[8 + n:]
with open(os.path.join(out, "py.expected"), "w") as f:
    for name, info in header.items():
        if name == "__metadata__":
            for k, v in info.items():
                f.write("M %s %s\n" % (k, v))
            continue
        b, e = info["data_offsets"]
        f.write("T %s %s %d %s %d %d %d\n" % (name, info["dtype"], len(info["shape"]),
                                           " ".join(str(d) for d in info["shape"]), b, e,
                                           sum(data[b:e]) & 0xFFFFFFFF))
print("wrote", path)
