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


def bench_training(workload, name, label, batch, steps, tf32=False):
    dev = torch.device("cuda:0" if label.startswith("cuda") else "cpu")
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.cuda.reset_peak_memory_stats(dev)
    model, shape = model_for(name)
    model = model.to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    x = torch.randn(batch, *shape, device=dev)
    y = torch.full((batch,), 3, dtype=torch.long, device=dev)
    if name == "gpt":   # AdamW (foreach: PyTorch's faster one on the CPU too), random tokens, a target per position
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0, foreach=True)
        x = torch.randint(0, 256, (batch, *shape), device=dev)
        y = torch.randint(0, 256, (batch * shape[0],), device=dev)

    def step():
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        opt.step()

    for _ in range(3):
        step()
    sync(dev)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        sync(dev)
        times.append(time.perf_counter() - t0)
    t = statistics.median(times)
    row(workload, label, "step", t * 1e3, "ms")
    if name == "mlp4096":
        # 3 GEMMs per Linear, none for the first layer's input gradient (x needs no gradient)
        flops = 2.0 * batch * (3.0 * (4 * 4096.0 * 4096.0 + 4096.0 * 10.0) - 4096.0 * 4096.0)
        row(workload, label, "tflops", flops / t / 1e12, "TFLOP/s")
        if gemm_tflops:
            row(workload, label, "of_gemm", flops / t / 1e12 / gemm_tflops, "x", "of the bare GEMM rate")
    if dev.type == "cuda":
        row(workload, label, "peak_mem", torch.cuda.max_memory_allocated(dev) / 1048576.0, "MiB")


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


row("torch", "-", "blas", 0, "", blas_library())
if which in ("cpu", "all", "steps"):
    bench_training("mlp784_b64", "mlp784", "cpu", 64, 50 if quick else 300)
    bench_training("cnn_b128", "cnn", "cpu", 128, 3 if quick else 30)
    bench_training("gpt_b16_t64", "gpt", "cpu", 16, 5 if quick else 40)
if which in ("cpu", "all"):
    bench_bandwidth("cpu", 256 << 20, 2 if quick else 5)
if which in ("cuda", "all") and torch.cuda.is_available():
    bench_gemm("cuda:0", 2048, 4096, 4096, 20)
    bench_training("mlp784_b64", "mlp784", "cuda:0", 64, 300)
    bench_training("mlp4096_b2048", "mlp4096", "cuda:0", 2048, 20, tf32=True)
    bench_training("cnn_b128", "cnn", "cuda:0", 128, 100)
    bench_bandwidth("cuda:0", 256 << 20, 20)
