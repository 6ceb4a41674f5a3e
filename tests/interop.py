"""PyTorch interop of mgpu checkpoints, both ways, with the real safetensors and torch packages.

  python3 tests/interop.py BUILD_DIR   (needs BUILD_DIR/interop, built by make)

1. mgpu -> PyTorch: build/interop saves the mlp and the cnn (the cnn also from a 2-stage
   pipeline on cpu:2, and PyTorch's cnn loads onto one); safetensors.torch.load_file plus
   load_state_dict (strict, once the optimizer.* entries are set aside) loads them into the
   equivalent nn.Sequential, whose logits must equal mgpu's.
2. PyTorch -> mgpu: torch saves its own models' state_dict with safetensors.torch.save_file;
   build/interop loads them, and its logits must equal PyTorch's.
   A PyTorch file holding the mlp under "model." beside other tensors loads with
   mgpu_model_load_ex (prefix, allow_extra); mgpu's reader reads its F16 tensor and metadata.
3. The file test_io wrote with mgpu's writer reads back in Python (tests/check_c_written.py).
4. float32 to bfloat16 (mgpu_tensor_convert to MGPU_BF16) gives PyTorch's bits.
Prints 'N passed, N failed, N skipped' last; skips (exit 0) when torch or safetensors is missing.
"""
import os
import subprocess
import sys
import tempfile

build = sys.argv[1] if len(sys.argv) > 1 else "build"
here = os.path.dirname(os.path.abspath(__file__))
passed = failed = skipped = 0


def check(ok, what):
    global passed, failed
    if ok:
        passed += 1
    else:
        failed += 1
        print("  FAIL", what)


try:
    import numpy as np
    import torch
    from torch import nn
    from safetensors.torch import load_file, save_file
except ImportError as e:
    print("  skip PyTorch interop: %s (install python3-torch and pip install safetensors)" % e)
    print("0 passed, 0 failed, 3 skipped")
    sys.exit(0)


def mlp():
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 128), nn.ReLU(), nn.Linear(128, 10))


def cnn():
    return nn.Sequential(nn.Conv2d(1, 16, 3, 1, 1), nn.ReLU(), nn.MaxPool2d(2, 2),
                         nn.Conv2d(16, 32, 3, 1, 1), nn.ReLU(), nn.MaxPool2d(2, 2),
                         nn.Flatten(), nn.Linear(32 * 7 * 7, 128), nn.ReLU(), nn.Linear(128, 10))


def logits_file(path, n):
    return torch.from_numpy(np.fromfile(path, dtype=np.float32).reshape(n, 10))


torch.manual_seed(0)
n = 32
x = torch.rand(n, 1, 28, 28) * 2.0 - 0.5
with tempfile.TemporaryDirectory() as d:
    x.numpy().astype(np.float32).tofile(os.path.join(d, "inputs.f32"))
    rc = subprocess.run([os.path.join(build, "interop"), "save", d]).returncode
    check(rc == 0, "interop save ran (exit %d)" % rc)
    for name, make in (("mlp", mlp), ("cnn", cnn), ("cnn_2stages", cnn)):   # the last saved by a 2-stage pipeline
        path = os.path.join(d, "mgpu_%s.safetensors" % name)
        if rc != 0 or not os.path.exists(path):
            check(False, "mgpu wrote %s" % path)
            continue
        sd = load_file(path)
        state = {k: v for k, v in sd.items() if not k.startswith("optimizer.")}
        extra = sorted(k for k in sd if k.startswith("optimizer."))
        model = make()
        try:
            model.load_state_dict(state, strict=True)
            loaded = True
        except Exception as e:
            print("   load_state_dict:", e)
            loaded = False
        check(loaded, "PyTorch load_state_dict(strict=True) of mgpu's %s checkpoint" % name)
        check(len(extra) == len(state) and all(k.endswith(".momentum_buffer") for k in extra),
              "%s: one momentum_buffer per parameter (%d of %d)" % (name, len(extra), len(state)))
        if loaded:
            with torch.no_grad():
                ref = model(x)
            got = logits_file(os.path.join(d, "mgpu_%s.logits" % name), n)
            err = (got - ref).abs().max().item()
            print("   mgpu -> torch %s: max |logit difference| %.3g" % (name, err))
            check(err < 1e-4, "%s logits from mgpu equal PyTorch's (max diff %.3g)" % (name, err))
    # PyTorch -> mgpu
    ref = {}
    for name, make in (("mlp", mlp), ("cnn", cnn)):
        torch.manual_seed(1)
        model = make()
        with torch.no_grad():
            for p in model.parameters():   # not zero-mean, so a transposed weight would show
                p.add_(0.01)
            ref[name] = model(x)
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, os.path.join(d, "torch_%s.safetensors" % name))
    rc = subprocess.run([os.path.join(build, "interop"), "load", d]).returncode
    check(rc == 0, "interop load ran (exit %d)" % rc)
    for name in ("mlp", "cnn", "cnn_2stages"):   # PyTorch's cnn loaded on a 2-stage pipeline too
        path = os.path.join(d, "torch_%s.mgpu_logits" % name)
        if rc != 0 or not os.path.exists(path):
            check(False, "mgpu computed logits for PyTorch's %s" % name)
            continue
        err = (logits_file(path, n) - ref[name.split("_")[0]]).abs().max().item()
        print("   torch -> mgpu %s: max |logit difference| %.3g" % (name, err))
        check(err < 1e-4, "%s: mgpu's logits from PyTorch's checkpoint equal PyTorch's (max diff %.3g)" % (name, err))

    # PyTorch -> mgpu, the model's part of a bigger file: the mlp under "model.", beside an
    # encoder's F16 weight and a head mgpu's model does not have (mgpu_model_load_ex with a prefix
    # and allow_extra; the encoder through mgpu's public reader)
    torch.manual_seed(2)
    model = mlp()
    with torch.no_grad():
        ref_part = model(x)
    enc = torch.randn(4, 3).half()
    part = {"model." + k: v.contiguous() for k, v in model.state_dict().items()}
    part["encoder.weight"] = enc
    part["head.bias"] = torch.zeros(7)
    save_file(part, os.path.join(d, "torch_part.safetensors"), metadata={"note": "from PyTorch"})
    rc = subprocess.run([os.path.join(build, "interop"), "part", d]).returncode
    check(rc == 0, "interop part ran (exit %d)" % rc)
    if rc == 0:
        err = (logits_file(os.path.join(d, "torch_part.mgpu_logits"), n) - ref_part).abs().max().item()
        print("   torch (prefix 'model.', extra tensors) -> mgpu mlp: max |logit difference| %.3g" % err)
        check(err < 1e-4, "a prefixed PyTorch file with extra tensors loads (max diff %.3g)" % err)
        got = torch.from_numpy(np.fromfile(os.path.join(d, "encoder.f32"), dtype=np.float32).reshape(4, 3))
        check(torch.equal(got, enc.float()), "mgpu_safetensors_read of PyTorch's F16 tensor equals it in float32")
        check(open(os.path.join(d, "note.txt")).read() == "from PyTorch", "mgpu_safetensors_metadata reads PyTorch's metadata")

    # PyTorch -> mgpu, a checkpoint in mixed dtypes (as bf16/fp16 training saves them): F32, BF16
    # and F16 tensors, each converted exactly to the model's F32 (load_state_dict does the same)
    torch.manual_seed(3)
    model = mlp()
    sd = model.state_dict()
    mixed = {"1.weight": sd["1.weight"].bfloat16(), "1.bias": sd["1.bias"].half(),
             "3.weight": sd["3.weight"].contiguous(), "3.bias": sd["3.bias"].bfloat16()}
    save_file(mixed, os.path.join(d, "torch_mixed.safetensors"))
    model.load_state_dict({k: v.float() for k, v in mixed.items()})
    with torch.no_grad():
        ref_mixed = model(x)
    rc = subprocess.run([os.path.join(build, "interop"), "mixed", d]).returncode
    check(rc == 0, "interop mixed ran (exit %d)" % rc)
    if rc == 0:
        err = (logits_file(os.path.join(d, "torch_mixed.mgpu_logits"), n) - ref_mixed).abs().max().item()
        print("   torch (F32, BF16, F16 tensors) -> mgpu mlp: max |logit difference| %.3g" % err)
        check(err <= 1e-6, "a checkpoint in F32, BF16 and F16 gives PyTorch's logits to 1e-6 (max diff %.3g)" % err)

    # float32 to bfloat16: mgpu_tensor_convert against PyTorch's .to(torch.bfloat16), bit for bit
    # (a NaN: a NaN either way; PyTorch's CPU kernels make every NaN 0xFFFF, its scalar code
    # 0x7FC0), on the floats that decide a rounding (each upper half with the low halves 0,
    # 0x7FFF, 0x8000, 0x8001, 0xFFFF) and random ones
    uppers = np.arange(0x10000, dtype=np.uint32) << 16
    lows = np.array([0x0, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=np.uint32)
    bits = np.concatenate([(uppers[:, None] | lows[None, :]).ravel(),
                           np.random.default_rng(4).integers(0, 2**32, 200000, dtype=np.uint64).astype(np.uint32)])
    bits.view(np.float32).tofile(os.path.join(d, "bf16_in.f32"))
    rc = subprocess.run([os.path.join(build, "interop"), "bf16", d]).returncode
    check(rc == 0, "interop bf16 ran (exit %d)" % rc)
    if rc == 0:
        got = np.fromfile(os.path.join(d, "bf16_out.u16"), dtype=np.uint16)
        want = torch.from_numpy(bits.view(np.float32)).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        check(len(got) == len(bits), "interop bf16 wrote %d values for %d floats" % (len(got), len(bits)))
        if len(got) == len(bits):
            nan_in = (bits & 0x7FFFFFFF) > 0x7F800000
            nan_got = (got & 0x7FFF) > 0x7F80
            same = np.where(nan_in, nan_got, got == want)
            print("   float32 -> bfloat16: %d floats, %d with other bits than PyTorch's" % (len(bits), int((~same).sum())))
            check(bool(same.all()), "mgpu's float32 -> bfloat16 gives PyTorch's bits (%d differ)" % int((~same).sum()))

c_written = os.path.join(build, "c_written.safetensors")
if os.path.exists(c_written):
    rc = subprocess.run([sys.executable, os.path.join(here, "check_c_written.py"), c_written]).returncode
    check(rc == 0, "Python safetensors reads the file mgpu's writer produced")
else:
    skipped += 1
    print("  skip %s not found (test_io writes it)" % c_written)
print("%d passed, %d failed, %d skipped" % (passed, failed, skipped))
sys.exit(1 if failed else 0)
