"""PyTorch's side of `make bench`: the workloads of bench/bench.c with the same shapes, dtypes and
optimizer, printed as the same tab-separated rows (workload, device, metric, value, unit, note).
Usage: python3 bench_torch.py THREADS [cpu|cuda|all|steps] [--quick]. CPU runs use THREADS threads,
as mgpu does. Times are medians after warm-up; GPU times include a synchronize per step."""
import statistics
import sys
import time

import torch
from torch import nn

threads = int(sys.argv[1]) if len(sys.argv) > 1 else 1
which = sys.argv[2] if len(sys.argv) > 2 else "all"
quick = "--quick" in sys.argv
torch.set_num_threads(threads)
gemm_tflops = None   # the bare GEMM rate, measured first on the GPU
gemm_tflops_bf16 = None   # the same forward GEMM (x @ W^T) in bf16 (bench_gemm_layouts)


def row(workload, device, metric, value, unit, note=""):
    print("%s\t%s\t%s\t%.6g\t%s\t%s" % (workload, device, metric, value, unit, note), flush=True)


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


class GPTBlock(nn.Module):
    """One GPT-2 block as examples/gpt.c's (and nanoGPT's on torch 1.13, which has no SDPA):
    x + attn(ln_1(x)), then x + mlp(ln_2(x)), tanh GELU, the causal mask a buffer."""

    def __init__(self, width, heads, T):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.c_attn, self.c_proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.c_fc, self.mlp_proj = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.register_buffer("mask", torch.ones(T, T, dtype=torch.bool).tril().logical_not())

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in self.c_attn(self.ln_1(x)).split(C, dim=2))
        a = (q @ k.transpose(-2, -1)) * (1.0 / (C // self.heads) ** 0.5)
        a = torch.softmax(a.masked_fill(self.mask[:T, :T], float("-inf")), dim=-1)
        x = x + self.c_proj((a @ v).transpose(1, 2).reshape(B, T, C))
        return x + self.mlp_proj(nn.functional.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    """bench.c's "gpt": vocabulary 256, 64 positions, 4 blocks of width 128 and 4 heads, the head
    tied to the token embedding"""

    def __init__(self, vocab=256, T=64, width=128, heads=4, layers=4):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(T, width)
        self.h = nn.ModuleList([GPTBlock(width, heads, T) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(width)
        self.register_buffer("pos", torch.arange(T))

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(self.pos[:idx.shape[1]])
        for block in self.h:
            x = block(x)
        return nn.functional.linear(self.ln_f(x), self.wte.weight).flatten(0, 1)


def model_for(name):
    if name == "gpt":
        return GPT(), (64,)
    if name == "gpt124m":   # GPT-2 124M's shape, as bench.c's "gpt124m"
        return GPT(vocab=50257, T=1024, width=768, heads=12, layers=12), (1024,)
    if name == "mlp784":
        return nn.Sequential(nn.Linear(784, 128), nn.ReLU(), nn.Linear(128, 10)), (784,)
    if name == "mlp4096":
        layers = []
        for _ in range(4):
            layers += [nn.Linear(4096, 4096), nn.ReLU()]
        return nn.Sequential(*layers, nn.Linear(4096, 10)), (4096,)
    return nn.Sequential(nn.Conv2d(1, 16, 3, 1, 1), nn.ReLU(), nn.MaxPool2d(2, 2),
                         nn.Conv2d(16, 32, 3, 1, 1), nn.ReLU(), nn.MaxPool2d(2, 2),
                         nn.Flatten(), nn.Linear(32 * 7 * 7, 128), nn.ReLU(), nn.Linear(128, 10)), (1, 28, 28)


def make_optimizer(name, params, fused):
    """The optimizer of bench.c's workload: SGD with momentum 0.9, the GPT's AdamW. fused: PyTorch's
    fused kernel (one launch for every parameter; SGD's from 2.1, AdamW's from 2.0), foreach (its
    default on GPUs, a few launches per group) otherwise. None where this PyTorch has no fused one."""
    try:
        if name.startswith("gpt"):
            return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0, **({"fused": True} if fused else {"foreach": True}))
        return torch.optim.SGD(params, lr=0.01, momentum=0.9, **({"fused": True} if fused else {}))
    except (TypeError, RuntimeError, ValueError):
        return None


def timed_steps(step, dev, steps):
    for _ in range(3):
        step()
    sync(dev)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        sync(dev)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def median_call(fn, dev, reps):
    """Seconds a call of fn takes: the median of reps timings of 10 calls back to back, after 3
    timings of warm-up (as bench.c times its GEMMs and kernels)"""
    times = []
    for i in range(reps + 3):
        sync(dev)
        t0 = time.perf_counter()
        for _ in range(10):
            fn()
        sync(dev)
        if i >= 3:
            times.append((time.perf_counter() - t0) / 10)
    return statistics.median(times)


def bench_training(workload, name, label, batch, steps, tf32=False, graph=False, bf16=False):
    """One training step of bench.c's workload, median seconds. On a GPU PyTorch's best is the
    anchor (the "step" row): its default foreach optimizer and its fused one are both timed, each
    with its own row (step_foreach, step_fused), and the faster is the step. graph: the whole step
    captured with torch.cuda.graph and replayed, as mgpu's graph rows are (PyTorch's recipe for
    whole-network capture: warm-up on a side stream, then forward, backward and opt.step in the
    graph). bf16: under torch.autocast(bfloat16), as PyTorch users train."""
    dev = torch.device("cuda:0" if label.startswith("cuda") else "cpu")
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32
    loss_fn = nn.CrossEntropyLoss()
    results = {}
    for fused in ((False, True) if dev.type == "cuda" else (False,)):
        torch.manual_seed(1)
        model, shape = model_for(name)
        model = model.to(dev)
        opt = make_optimizer(name, model.parameters(), fused)
        if opt is None:
            row(workload, label, "step_fused", 0, "ms", "no fused optimizer in this PyTorch")
            continue
        if name.startswith("gpt"):   # random tokens, a target per position
            vocab = model.wte.num_embeddings
            x = torch.randint(0, vocab, (batch, *shape), device=dev)
            y = torch.randint(0, vocab, (batch * shape[0],), device=dev)
        else:
            x = torch.randn(batch, *shape, device=dev)
            y = torch.full((batch,), 3, dtype=torch.long, device=dev)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)

        def eager():
            opt.zero_grad(set_to_none=True)
            with torch.autocast(device_type=dev.type, dtype=torch.bfloat16, enabled=bf16):
                loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()

        step = eager
        if graph:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    eager()
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            opt.zero_grad(set_to_none=True)
            with torch.cuda.graph(g):
                with torch.autocast(device_type=dev.type, dtype=torch.bfloat16, enabled=bf16):
                    loss = loss_fn(model(x), y)
                loss.backward()
                opt.step()
            step = g.replay
        t = timed_steps(step, dev, steps)
        kind = "fused" if fused else "foreach" if dev.type == "cuda" else ""
        if dev.type == "cuda":
            row(workload, label, "step_" + kind, t * 1e3, "ms", "torch.cuda.graph" if graph else "")
        results[kind] = (t, torch.cuda.max_memory_allocated(dev) / 1048576.0 if dev.type == "cuda" else None)
    if not results:
        return
    kind = min(results, key=lambda k: results[k][0])
    t, peak = results[kind]
    note = ", ".join(x for x in ("%s %s" % (kind, "AdamW" if name.startswith("gpt") else "SGD") if kind else "",
                                 "torch.cuda.graph" if graph else "", "bf16 autocast" if bf16 else "") if x)
    row(workload, label, "step", t * 1e3, "ms", note)
    if name == "mlp4096":
        # 3 GEMMs per Linear, none for the first layer's input gradient (x needs no gradient)
        flops = 2.0 * batch * (3.0 * (4 * 4096.0 * 4096.0 + 4096.0 * 10.0) - 4096.0 * 4096.0)
        row(workload, label, "tflops", flops / t / 1e12, "TFLOP/s")
        bare = gemm_tflops_bf16 if bf16 else gemm_tflops
        if bare:
            row(workload, label, "of_gemm", flops / t / 1e12 / bare, "x",
                "of the bare bf16 GEMM rate (x W^T)" if bf16 else "of the bare GEMM rate")
    if peak is not None:
        row(workload, label, "peak_mem", peak, "MiB", note)


def bench_gemm_layouts(m, n, k, reps):
    """The ceilings of a Linear step's three GEMMs on [m, k] inputs and a [n, k] weight, in TF32 and
    bf16: forward y = x @ W^T, the weight gradient dW = dy^T @ x, the input gradient dx = dy @ W
    (PyTorch-only rows: what mgpu's step is measured against)."""
    global gemm_tflops_bf16
    dev = torch.device("cuda:0")
    for dtype, tag in ((torch.float32, "tf32"), (torch.bfloat16, "bf16")):
        torch.backends.cuda.matmul.allow_tf32 = dtype == torch.float32
        x = torch.randn(m, k, device=dev, dtype=dtype)
        w = torch.randn(n, k, device=dev, dtype=dtype)
        dy = torch.randn(m, n, device=dev, dtype=dtype)
        for what, fn in (("x@W^T", lambda: torch.matmul(x, w.t())), ("dy^T@x", lambda: torch.matmul(dy.t(), x)),
                         ("dy@W", lambda: torch.matmul(dy, w))):
            rate = 2.0 * m * n * k / median_call(fn, dev, reps) / 1e12
            row("gemm_%dx%dx%d_%s" % (m, n, k, tag), "cuda:0", what, rate, "TFLOP/s", "PyTorch's matmul")
            if tag == "bf16" and what == "x@W^T":
                gemm_tflops_bf16 = rate
    torch.backends.cuda.matmul.allow_tf32 = False


def bench_attention(T, hs, reps):
    """Causal attention alone on bench.c's shape (16K tokens of width 2048, heads of size hs):
    F.scaled_dot_product_attention on q, k, v viewed out of one packed [B, T, 3 D] tensor, as
    nanoGPT calls it, forward and backward, in fp32 (mgpu's kernels' precision) and bf16; FLOPs as
    bench.c counts them."""
    import torch.nn.functional as F
    name = "attention_causal_t%d_hs%d" % (T, hs)
    if not hasattr(F, "scaled_dot_product_attention"):
        row(name, "cuda:0", "skipped", 0, "", "this PyTorch has no F.scaled_dot_product_attention (2.0 or later)")
        return
    dev = torch.device("cuda:0")
    B, H = 16384 // T, 2048 // hs
    fwd_flops = 2.0 * B * H * T * T * hs
    for dtype, tag in ((torch.float32, ""), (torch.bfloat16, "_bf16")):
        qkv = torch.randn(B, T, 3, H, hs, device=dev, dtype=dtype, requires_grad=True)
        dy = torch.randn(B, H, T, hs, device=dev, dtype=dtype)

        def forward():
            q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = forward()
        for metric, fn, flops in (("forward", forward, fwd_flops),
                                  ("backward", lambda: torch.autograd.grad(y, qkv, dy, retain_graph=True), 2.5 * fwd_flops)):
            row(name, "cuda:0", metric + tag, flops / median_call(fn, dev, reps) / 1e12, "TFLOP/s",
                "F.scaled_dot_product_attention, %s" % ("fp32" if dtype == torch.float32 else "bf16"))
        del qkv, dy, y


def bench_bandwidth(label, nbytes, reps):
    dev = torch.device("cuda:0" if label.startswith("cuda") else "cpu")
    n = nbytes // 4
    a = torch.rand(n, device=dev)
    b = torch.rand(n, device=dev)
    c = torch.empty(n, device=dev)

    def timed(fn):
        fn()
        times = []
        for _ in range(reps):
            sync(dev)
            t0 = time.perf_counter()
            fn()
            sync(dev)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    copy = 2.0 * nbytes / timed(lambda: c.copy_(a)) / 1e9
    row("copy_256MiB", label, "bandwidth", copy, "GB/s", "reads+writes per second")
    add = 3.0 * nbytes / timed(lambda: torch.add(a, b, out=c)) / 1e9
    row("add_256MiB", label, "bandwidth", add, "GB/s")
    row("add_256MiB", label, "of_copy", add / copy, "x")
    p = nn.Parameter(torch.rand(n, device=dev))
    p.grad = torch.rand(n, device=dev)
    opt = torch.optim.SGD([p], lr=0.01, momentum=0.9)
    sgd = 5.0 * nbytes / timed(opt.step) / 1e9
    row("sgd_step_256MiB", label, "bandwidth", sgd, "GB/s")
    row("sgd_step_256MiB", label, "of_copy", sgd / copy, "x")


def bench_gemm(label, m, n, k, reps):
    """The large MLP's GEMM, out = x @ W^T with TF32: the rate its step is measured against."""
    dev = torch.device("cuda:0")
    torch.backends.cuda.matmul.allow_tf32 = True
    a = torch.randn(m, k, device=dev)
    b = torch.randn(n, k, device=dev)
    times = []
    for i in range(reps + 3):   # 10 back to back per timing, as bench.c does
        sync(dev)
        t0 = time.perf_counter()
        for _ in range(10):
            torch.matmul(a, b.t())
        sync(dev)
        if i >= 3:
            times.append((time.perf_counter() - t0) / 10)
    global gemm_tflops
    gemm_tflops = 2.0 * m * n * k / statistics.median(times) / 1e12
    row("gemm_%dx%dx%d" % (m, n, k), label, "tflops", gemm_tflops, "TFLOP/s")
    torch.backends.cuda.matmul.allow_tf32 = False


row("torch", "-", "version", 0, torch.__version__)


def blas_library():
    """The BLAS PyTorch's CPU matmul runs on: the library mapped into this process after one
    (Debian's torch calls libblas.so.3, which is OpenBLAS when libopenblas0-pthread is installed
    and the slow reference BLAS otherwise)."""
    import os
    torch.mm(torch.ones(64, 64), torch.ones(64, 64))
    try:
        libs = {line.split()[-1] for line in open("/proc/self/maps") if "blas" in line.lower() or "mkl" in line.lower()}
    except OSError:
        return "unknown"
    return ", ".join(sorted(os.path.realpath(x) for x in libs if x.startswith("/"))) or "none found (its own)"



# PyTorch on the CPU runs two thread pools: its own (OpenMP, torch.set_num_threads) and OpenBLAS's,
# under every matmul. On a small machine the two can fight for the cores: on the 2-core VM of
# 2026-11-27 the GPT step took 160-180 ms with the defaults and 51-65 ms with either pool tamed, the
# CNN's 22 ms against 10. The anchor is PyTorch at its best, as a user who tunes it would run it:
# each CPU step is measured under three settings, each in a process of its own (both libraries read
# them at start-up), the fastest being the "step" row with its setting in the note, and the
# default's the "step_default" row.
CPU_SETTINGS = (("default", {}), ("OMP_WAIT_POLICY=PASSIVE", {"OMP_WAIT_POLICY": "PASSIVE"}),
                ("OPENBLAS_NUM_THREADS=1", {"OPENBLAS_NUM_THREADS": "1"}))


def bench_cpu_steps():
    import os
    import subprocess
    best = {}
    for name, env in CPU_SETTINGS:
        child_env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OPENBLAS_NUM_THREADS")}
        child_env.update(env)   # the defaults are PyTorch's, not whatever this shell exported
        try:
            out = subprocess.run([sys.executable, __file__, str(threads), "cpu-steps"] + (["--quick"] if quick else []),
                                 env=child_env, stdout=subprocess.PIPE, check=True, universal_newlines=True).stdout
        except subprocess.CalledProcessError as e:
            print("bench_torch: the CPU steps with %s failed (%s); the others still count" % (name, e), file=sys.stderr)
            continue
        for line in out.splitlines():
            f = line.split("\t")
            if len(f) < 4 or f[2] != "step":
                continue
            if name == "default":
                row(f[0], f[1], "step_default", float(f[3]), "ms", "PyTorch's default thread settings")
            if f[0] not in best or float(f[3]) < best[f[0]][0]:
                best[f[0]] = (float(f[3]), f[1], name)
    for workload, (t, label, name) in best.items():
        row(workload, label, "step", t, "ms", "the fastest of %d thread settings: %s" % (len(CPU_SETTINGS), name))


if which == "cpu-steps":   # one setting's CPU steps, in a child of bench_cpu_steps
    bench_training("mlp784_b64", "mlp784", "cpu", 64, 50 if quick else 300)
    bench_training("cnn_b128", "cnn", "cpu", 128, 3 if quick else 30)
    bench_training("gpt_b16_t64", "gpt", "cpu", 16, 5 if quick else 40)
    sys.exit(0)
row("torch", "-", "blas", 0, "", blas_library())
if which in ("cpu", "all", "steps"):
    bench_cpu_steps()
if which in ("cpu", "all"):
    bench_bandwidth("cpu", 256 << 20, 2 if quick else 5)
if which in ("cuda", "all") and torch.cuda.is_available():
    bench_gemm("cuda:0", 2048, 4096, 4096, 20)
    bench_gemm_layouts(2048, 4096, 4096, 20)
    bench_training("mlp784_b64", "mlp784", "cuda:0", 64, 300)
    bench_training("mlp4096_b2048", "mlp4096", "cuda:0", 2048, 20, tf32=True)
    bench_training("cnn_b128", "cnn", "cuda:0", 128, 100)
    # the fair anchors of mgpu's graph steps, and the bf16 that PyTorch users train in
    bench_training("mlp784_b64_graph", "mlp784", "cuda:0", 64, 300, graph=True)
    bench_training("cnn_b128_graph", "cnn", "cuda:0", 128, 100, graph=True)
    bench_training("mlp4096_b2048_bf16", "mlp4096", "cuda:0", 2048, 20, bf16=True)
    bench_training("mlp4096_b2048_bf16_graph", "mlp4096", "cuda:0", 2048, 20, bf16=True, graph=True)
    bench_training("gpt_b16_t64", "gpt", "cuda:0", 16, 100)
    for T, hs in ((1024, 64), (2048, 64), (1024, 128), (2048, 128)):
        bench_attention(T, hs, 10)
    bench_training("gpt124m_b8_t1024", "gpt124m", "cuda:0", 8, 5)
    bench_training("gpt124m_b8_t1024_bf16", "gpt124m", "cuda:0", 8, 5, tf32=True, bf16=True)
    bench_bandwidth("cuda:0", 256 << 20, 20)
