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
torch_version = next((r[4] for r in theirs if r[0] == "torch"), None)
ref = {(w, d, m): v for w, d, m, v, u, n in theirs}
lower_is_better = {"ms", "us"}
# goals of the benchmark issue: (workload, device prefix, metric) -> (test, text)
goals = {
    ("mlp784_b64", "cpu", "step"): (lambda v, t: t is not None and t / v >= 3.0, ">= 3x PyTorch"),
    ("mlp784_b64", "cuda:0", "step"): (lambda v, t: t is not None and t / v >= 5.0, ">= 5x PyTorch"),
    ("mlp4096_b2048", "cuda:0", "step"): (lambda v, t: t is not None and t / v >= 1.0, ">= PyTorch"),
    ("add_256MiB", "cuda:0", "of_copy"): (lambda v, t: v >= 0.8, ">= 0.8 of copy"),
    ("sgd_step_256MiB", "cuda:0", "of_copy"): (lambda v, t: v >= 0.8, ">= 0.8 of copy"),
}


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
         "- PyTorch: %s" % (torch_version or "not installed: no PyTorch column"), "",
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
        elif m == "allocs_per_step":
            theirs_text = "no counterpart"
        elif m == "peak_mem" and d.startswith("cpu"):
            theirs_text = "no CPU peak counter"
        elif d.startswith("cpu:") or w.startswith("allreduce"):
            theirs_text = "no one-process counterpart (DDP needs a process per replica)"
        else:
            theirs_text = "not measured"
        ratio = ""
    else:
        theirs_text = "%.4g %s" % (t, u)
        if u in lower_is_better:
            ratio = "%.2fx faster" % (t / v) if t >= v else "%.2fx slower" % (v / t)
        else:
            ratio = "%.2fx" % (v / t) if t else ""
    goal = goals.get((w, d, m))
    goal_text = ""
    if goal:
        goal_text = "%s: %s" % (goal[1], "met" if goal[0](v, t) else "NOT met")
    lines.append("| %s | %s | %s | %.4g %s | %s | %s | %s |" % (w, d, m, v, u, theirs_text, ratio, goal_text))
text = "\n".join(lines) + "\n"
print(text)
with open(out_path, "w") as f:
    f.write(text)
