"""Each arm's per-pair ratios in this folder's decoder-benchmark logs: their median (the
benchmark's headline), interquartile range, and a distribution-free 95 % interval for the
median from order statistics (ranks n/2 -+ 1.96 sqrt(n)/2).

    python lab/evidence/gpu-h100/decoder-4/median_intervals.py
"""

import math
import re
import statistics
from pathlib import Path

HERE = Path(__file__).resolve().parent
ARM = re.compile(
    r"(\S+): step time FLoRG / LoRA ([\d.]+) \(wall time, median of the per-pair ratios ([^;]+);"
)

for log in sorted(HERE.glob("call*.log")):
    if "side-by-side" in log.name:
        continue  # the same arms as the before / after logs, in one stream
    for arm, median, ratios in ARM.findall(log.read_text()):
        xs = sorted(float(x) for x in ratios.split(","))
        n = len(xs)
        q1, _, q3 = statistics.quantiles(xs, n=4)
        k = int(n / 2 - 1.96 * math.sqrt(n) / 2)
        print(
            f"{log.name}: {arm}: median {median} over {n} pairs, interquartile {q1:.3f}-{q3:.3f}, "
            f"95 % interval of the median {xs[k]:.3f}-{xs[n - 1 - k]:.3f}"
        )
