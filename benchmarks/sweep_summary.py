"""Counts a property sweep's logged examples (`PALLAS_FLASH_SWEEP_LOG` JSONL, one line per
example: path, seed, config, violations): configurations and failures per path, and the first
failures as drawn.

    python benchmarks/sweep_summary.py LOG.jsonl [LOG.jsonl ...]
"""

from __future__ import annotations

import collections
import json
import sys


def main(paths):
    total = collections.Counter()
    failed = collections.defaultdict(list)
    for path in paths:
        with open(path) as f:
            for line in f:
                row = json.loads(line)
                total[row["path"]] += 1
                if row["violations"]:
                    failed[row["path"]].append(row)
    for name in sorted(total):
        print(f"{name:18s} {total[name]:5d} configurations, {len(failed[name]):3d} failed")
    print(
        f"{'all':18s} {sum(total.values()):5d} configurations, "
        f"{sum(map(len, failed.values())):3d} failed"
    )
    for name in sorted(failed):
        for row in failed[name][:5]:
            print(f"\n{name} seed={row['seed']} {row['config']}")
            print("  " + "\n  ".join(row["violations"]))


if __name__ == "__main__":
    main(sys.argv[1:])
