"""Draw mgpu traces (mgpu_model_trace_stop, build/train --trace) as timelines, one panel per trace.
(Without Python: a trace path ending in .svg makes mgpu draw the picture itself.)

  python3 tools/plot_trace.py OUT.png TRACE.json [TRACE.json ...]

Each panel shows one step (the first optimizer step's forward and backward slices and what lies
between): a row per device's compute stream, forwards in blue, backwards in orange, all-reduces and
optimizer steps in grey, each slice labelled with its micro-batch. Needs matplotlib (Debian:
python3-matplotlib). The picture of GPipe and 1F1B in docs/pipelines.md comes from it:
  build/train --model cnn --devices cpu:4 --stages 4 --micro-batches 8 --pipeline gpipe --trace g.json ...
"""
import json
import sys

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt


def load(path):
    data = json.load(open(path))
    events = data["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "thread_name"}
    title = next((e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "process_name"), path)
    slices = [e for e in events if e.get("ph") == "X"]
    # one step: from the first slice to the end of the first optimizer step of the last track
    steps = sorted({e["name"] for e in slices if e["name"].startswith("optimizer step")},
                   key=lambda n: int(n.split()[-1]))
    if steps:
        first_opt = [e for e in slices if e["name"] == steps[0]]
        end = max(e["ts"] + e["dur"] for e in first_opt)
        start = min(e["ts"] for e in slices if e["ts"] + e["dur"] <= end)
        slices = [e for e in slices if e["ts"] >= start and e["ts"] + e["dur"] <= end]
    return title, names, slices


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    traces = [load(p) for p in sys.argv[2:]]
    fig, axes = plt.subplots(len(traces), 1, figsize=(11, 1.2 + 0.55 * max(len(t[1]) // 2 for t in traces) * len(traces)),
                             squeeze=False)
    for ax, (title, names, slices) in zip(axes[:, 0], traces):
        tracks = sorted({e["tid"] for e in slices if e["tid"] % 2 == 0})
        t0 = min(e["ts"] for e in slices)
        for row, tid in enumerate(tracks):
            for e in (e for e in slices if e["tid"] in (tid, tid + 1)):
                kind = e["name"].split()[0]
                color = {"F": "tab:blue", "B": "tab:orange"}.get(kind, "0.6")
                y = row + (0.25 if e["tid"] == tid + 1 else 0.0)
                ax.broken_barh([((e["ts"] - t0) / 1e3, e["dur"] / 1e3)], (y - 0.35, 0.7 if e["tid"] == tid else 0.2),
                               facecolors=color, edgecolors="white", linewidth=0.5)
                if kind in ("F", "B") and e["dur"] > 0:
                    ax.text((e["ts"] - t0 + e["dur"] / 2) / 1e3, y, e["name"].split()[1], ha="center", va="center",
                            fontsize=7, color="white")
        ax.set_yticks(range(len(tracks)))
        ax.set_yticklabels([names.get(t, str(t)) for t in tracks], fontsize=8)
        ax.invert_yaxis()
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("ms", fontsize=8)
    fig.tight_layout()
    fig.savefig(sys.argv[1], dpi=110)


if __name__ == "__main__":
    main()
