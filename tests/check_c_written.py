"""Reads the file test_io.c wrote with mgpu__st_write using the reference Python implementation
and checks every tensor and the metadata. Exit status 0 when all match."""
import sys

import numpy as np
from safetensors import safe_open
from safetensors.numpy import load_file

path = sys.argv[1]
t = load_file(path)
expect = {
    "w": np.arange(6, dtype=np.float32).reshape(2, 3) * 0.5,
    "idx": np.array([-1, 0, 1, 2], dtype=np.int32),
    "mask": np.array([1, 0, 255], dtype=np.uint8),
    "d": np.array(3.25, dtype=np.float64),
    "empty": np.zeros((0, 4), dtype=np.float32),
    'name with "quotes", \\ and \n newline': np.array([7.0], dtype=np.float32),
    "h\u00e9llo \U0001F600": np.array([1, -2], dtype=np.int64),
}
ok = True
if sorted(t) != sorted(expect):
    print("names differ:", sorted(t), sorted(expect))
    ok = False
for k, v in expect.items():
    if k in t and (t[k].dtype != v.dtype or t[k].shape != v.shape or not np.array_equal(t[k], v)):
        print("tensor differs:", repr(k), t[k].dtype, t[k].shape, v.dtype, v.shape)
        ok = False
with safe_open(path, "np") as f:
    md = f.metadata()
want_md = {"format": "pt", "note": 'tab\there "q" \u00e9'}
if md != want_md:
    print("metadata differs:", md, want_md)
    ok = False
print("python safetensors reads the C-written file:", "OK" if ok else "MISMATCH")
sys.exit(0 if ok else 1)
