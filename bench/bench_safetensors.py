"""The reference library's side of bench/bench.c's safetensors row: times safe_open plus
get_tensor of every tensor (numpy), by name in the file's order, median of 3, on the file bench
wrote. Usage: bench_safetensors.py PATH WORKLOAD. Prints one row like bench's."""
import sys
import time

from safetensors import __version__, safe_open

path, workload = sys.argv[1:3]
times = []
for _ in range(3):
    t0 = time.perf_counter()
    with safe_open(path, "np") as f:
        for k in f.keys():
            f.get_tensor(k)
    times.append(time.perf_counter() - t0)
times.sort()
print("%s\tcpu\topen_read_all\t%.6g\tms\tsafetensors %s (Python, numpy)" % (workload, times[1] * 1e3, __version__), flush=True)
