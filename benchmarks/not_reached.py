"""The node ids of a list that a capped `pytest -v` run did not report (passed, failed, skipped,
xfailed, xpassed or errored), one per line: the next call's TEST_IDS.

    python benchmarks/not_reached.py IDS.txt PYTEST.log > LEFT.txt

Prints the counts to stderr.
"""

from __future__ import annotations

import re
import sys

# pytest -v (with xdist: "[gw3] [ 27%] PASSED tests/...::name[params]"); ids may hold spaces.
OUTCOME = re.compile(r"\b(PASSED|FAILED|SKIPPED|XFAIL|XPASS|ERROR) (tests/\S.*?)\s*$")


def reported(log_lines) -> set[str]:
    return {m.group(2) for line in log_lines if (m := OUTCOME.search(line))}


def main(ids_path: str, log_path: str) -> list[str]:
    with open(ids_path) as f:
        ids = [line.strip() for line in f if line.strip()]
    with open(log_path, errors="replace") as f:
        done = reported(f)
    left = [i for i in ids if i not in done]
    print(
        f"{len(ids)} ids, {len(ids) - len(left)} reported, {len(left)} not reached", file=sys.stderr
    )
    return left


if __name__ == "__main__":
    print("\n".join(main(*sys.argv[1:3])))
