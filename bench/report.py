"""Joins bench/bench (mgpu) and bench/bench_torch.py (PyTorch) rows into one markdown table with
the date, machine, devices and commit; prints it and writes it to the file given.
Usage: report.py MGPU_TSV TORCH_TSV OUT_MD COMMIT. A missing PyTorch shows as such, never as a number."""
import datetime
import os
import platform
import subprocess
import sys

mgpu_path, torch_path, out_path, commit = sys.argv[1:5]


def rows(path):
    out = []
    if os.path.exists(path):
        for line in open(path):
            f = line.rstrip("\n").split("\t")
            if len(f) >= 5:
                out.append((f[0], f[1], f[2], float(f[3]), f[4], f[5] if len(f) > 5 else ""))
    return out


mine, theirs = rows(mgpu_path), rows(torch_path)
# the large MLP is judged against the faster of the two bare GEMMs (mgpu's cuBLAS call, PyTorch's)
gemm_rates = [r[3] for r in mine + theirs if r[0].startswith("gemm_") and r[2] == "tflops"]
best_gemm = max(gemm_rates) if gemm_rates else None
torch_version = next((r[4] for r in theirs if r[0] == "torch" and r[2] == "version"), None)
torch_blas = next((r[5] for r in theirs if r[0] == "torch" and r[2] == "blas"), None)
ref = {(w, d, m): v for w, d, m, v, u, n in theirs}
ref_note = {(w, d, m): n for w, d, m, v, u, n in theirs}
native_step = {(w, d): v for w, d, m, v, u, n in mine if m == "step"}   # the -march=native build's, for the plain one
lower_is_better = {"ms", "us"}
# goals of the benchmark issue: (test of workload, device, metric) -> (test of mgpu's value v and
# PyTorch's t, text)
def faster(k):
    return lambda v, t: t is not None and t / v >= k


def one_gpu(d):
    """cuda:0,0 or cuda:0,0,0,0: several replicas of one GPU (virtual devices)"""
    ords = d[5:].split(",") if d.startswith("cuda:") else []
    return len(ords) > 1 and len(set(ords)) == 1


def default_p2p(w):
    return w.startswith("allreduce_p2p-") and "-forced" not in w


goals = [
    (lambda w, d, m: (w, d, m) == ("mlp784_b64", "cpu", "step"), faster(2.5), ">= 2.5x PyTorch"),
    (lambda w, d, m: (w, d, m) == ("mlp784_b64", "cuda:0", "step"), faster(5.0), ">= 5x PyTorch"),
    (lambda w, d, m: (w, d, m) == ("mlp4096_b2048", "cuda:0", "step"), faster(1.0), ">= PyTorch"),
    (lambda w, d, m: (w, d, m) == ("mlp4096_b2048", "cuda:0", "tflops"),
     lambda v, t: best_gemm is not None and v >= 0.85 * best_gemm,
     ">= 0.85 of the faster bare GEMM (%s TFLOP/s)" % ("%.4g" % best_gemm if best_gemm else "not measured")),
    (lambda w, d, m: w in ("add_256MiB", "sgd_step_256MiB") and d.startswith("cuda") and m == "of_copy",
     lambda v, t: v >= 0.8, ">= 0.8 of copy"),
    (lambda w, d, m: default_p2p(w) and w.endswith("_4KiB") and d == "cuda:0,0,0,0" and m == "time",
     lambda v, t: v < 20.0, "< 20 us"),
    (lambda w, d, m: default_p2p(w) and w.endswith("_1048576KiB") and one_gpu(d) and m == "mem_of_copy",
     lambda v, t: v >= 0.7, ">= 0.7 of copy"),
    (lambda w, d, m: d.startswith("cuda") and m == "peak_mem", lambda v, t: None if t is None else v <= t, "<= PyTorch"),
    (lambda w, d, m: m == "allocs_per_step", lambda v, t: v == 0, "0"),
    (lambda w, d, m: w.startswith("safetensors_") and m == "open_read_all",
     lambda v, t: None if t is None else v <= 10 * t, "<= 10x the reference library (Python safetensors)"),
    (lambda w, d, m: w.startswith("gemm_") and d == "cpu" and m == "of_openblas", lambda v, t: v >= 0.9, ">= 0.9 of OpenBLAS"),
    (lambda w, d, m: w == "gemm_2048x4096x4096" and d == "cpu" and m == "of_peak", lambda v, t: v >= 0.8, ">= 0.8 of the FMA peak"),
    (lambda w, d, m: (w, d, m) == ("cnn_b128", "cpu", "step"), faster(1.5), ">= 1.5x PyTorch"),
    (lambda w, d, m: (w, d, m) == ("gpt_b16_t64", "cpu", "step"), faster(1.5), ">= 1.5x PyTorch"),
    (lambda w, d, m: (w, d, m) == ("mlp784_b64_graph", "cuda:0", "step"), faster(1.0), ">= PyTorch's graphed step"),
    (lambda w, d, m: (w, d, m) == ("mlp784_b64_plain_O2", "cpu", "step"),
     lambda v, t: None if ("mlp784_b64", "cpu") not in native_step else v <= 1.1 * native_step[("mlp784_b64", "cpu")],
     "within 10% of the -march=native build"),
]


def goal_for(w, d, m):
    return next(((test, text) for match, test, text in goals if match(w, d, m)), None)

def cpu_name():
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def gpu_name():
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=20).stdout.strip().replace("\n", ", ") or "none"
    except (OSError, subprocess.SubprocessError):
        return "none"


lines = ["# mgpu benchmarks", "",
         "- date: %s" % datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
         "- machine: %s, %d CPUs (%s)" % (cpu_name(), os.cpu_count() or 0, platform.node()),
         "- GPU: %s" % gpu_name(),
         "- commit: %s" % commit,
         "- PyTorch: %s" % (torch_version or "not installed: no PyTorch column"),
         "- PyTorch's BLAS: %s" % (torch_blas or "unknown"), "",
         "| workload | device | metric | mgpu | PyTorch | mgpu vs PyTorch | goal |",
         "| --- | --- | --- | --- | --- | --- | --- |"]
for w, d, m, v, u, note in mine:
    if w in ("threads",):
        lines.insert(5, "- CPU threads (both sides): %d" % int(v))
        continue
    if m == "skipped":
        lines.append("| %s | %s | | skipped: %s | | | |" % (w, d, note))
        continue
    t = ref.get((w, d, m))
    if t is None:
        if not torch_version:
            theirs_text = "no PyTorch"
        elif w.startswith("gemm_") and d == "cpu" or w == "fma_peak":
            theirs_text = "n/a (OpenBLAS rows)"
        elif m == "allocs_per_step":
            theirs_text = "n/a"
        elif w.endswith("_plain_O2"):
            theirs_text = "n/a (cc -O2 build)"
        elif m == "peak_mem" and d.startswith("cpu"):
            theirs_text = "n/a (no CPU counter)"
        elif w.startswith("pipe_"):
            theirs_text = "n/a (pipeline)"
        elif "," in d or d.startswith("cpu:") or w.startswith(("allreduce", "dp_")):
            theirs_text = "n/a (DDP)"
        else:
            theirs_text = "not measured"
        ratio = ""
    else:
        theirs_text = "%.4g %s" % (t, u)
        if ref_note.get((w, d, m), "").startswith("the fastest of"):   # which thread setting gave PyTorch's best
            theirs_text += " (%s)" % ref_note[(w, d, m)].split(": ", 1)[-1]
        if u in lower_is_better:
            ratio = "%.2fx faster" % (t / v) if t >= v else "%.2fx slower" % (v / t)
        else:
            ratio = "%.2fx" % (v / t) if t else ""
    goal = goal_for(w, d, m)
    goal_text = ""
    if goal:
        verdict = goal[0](v, t)
        goal_text = "%s: %s" % (goal[1], "n/a" if verdict is None else "met" if verdict else "NOT met")
    lines.append("| %s | %s | %s | %.4g %s | %s | %s | %s |" % (w, d, m, v, u, theirs_text, ratio, goal_text))
# PyTorch's rows without an mgpu counterpart (the anchors mgpu has no row for yet: bf16, each
# GEMM layout, each optimizer kind), so that every number measured is in the file
mine_keys = {(w, d, m) for w, d, m, v, u, n in mine}
only_theirs = [r for r in theirs if (r[0], r[1], r[2]) not in mine_keys and r[0] != "torch"]
if only_theirs:
    lines += ["", "PyTorch's rows without an mgpu counterpart:", "", "| workload | device | metric | PyTorch | note |",
              "| --- | --- | --- | --- | --- |"]
    lines += ["| %s | %s | %s | %.4g %s | %s |" % (w, d, m, v, u, n) for w, d, m, v, u, n in only_theirs]
lines += ["", "PyTorch's CPU steps: the fastest of three thread settings, each in a process of its own (its "
          "defaults, OMP_WAIT_POLICY=PASSIVE, OPENBLAS_NUM_THREADS=1), named in brackets: its OpenMP pool and "
          "OpenBLAS's can oversubscribe a small machine; step_default: with its defaults. "
          "n/a (DDP): PyTorch replicates across processes (DistributedDataParallel), so a one-process "
          "figure has no counterpart. n/a (no CPU counter): PyTorch counts peak memory on GPUs only. "
          "mem_bw: the bytes an all-reduce reads plus writes in the memory its replicas share, per second; "
          "mem_of_copy and of_copy: against a device-to-device copy measured in the same run. "
          "dp_ rows: hidden is the share of the all-reduce time that the step hides behind backward. "
          "n/a (pipeline): PyTorch's pipelines (torch.distributed.pipelining) run one process per stage; "
          "pipe_ rows: the bubble is the idle share of a traced step's forward-backward span, averaged over "
          "the stages, beside the theoretical (S-1)/(M+S-1). safetensors_ rows: the PyTorch column is the "
          "reference library, Python safetensors (numpy), reading the same file."]
text = "\n".join(lines) + "\n"
print(text)
with open(out_path, "w") as f:
    f.write(text)
