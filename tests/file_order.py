"""The order in which pytest-xdist hands test files to its workers: the slowest first.

With ``--dist loadfile`` each file is one unit of work, and a worker that finishes early takes the next
unit from the queue. xdist's own order (``loadscopereorder``: most tests first) puts files with many
fast tests first and the long end-to-end files, which have few tests and long set-ups, last: the run
then ends with one worker finishing a long file while the other has nothing left to do. Handing out
the longest files first (the classic longest-processing-time rule) keeps both workers busy to the end.

The weights are each file's measured seconds (set-up + call + teardown of all its tests) from a
``--durations=0`` run, kept in ``file_durations.json``. A file missing from the table (a new one) goes
first: its cost is unknown, and a long file started last is the costly mistake. Regenerate the table
from the log of a full run::

    python -m pytest -q -n 2 --dist loadfile --durations=0 > full.log
    python -m tests.file_order full.log

Invariants (``tests/test_file_order.py``): the order is a permutation of the collected items; a file's
items stay contiguous and in their collected order (module fixtures are built once); files with equal
weight keep their collected order.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from collections.abc import Sequence

TABLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "file_durations.json")
_DURATION_LINE = re.compile(r"^(?P<seconds>\d+(?:\.\d+)?)s (?:setup|call|teardown)\s+(?P<nodeid>\S+)")


def load_weights(path: str = TABLE) -> dict[str, float]:
    """``{file path relative to the repo: seconds}``; empty when the table is absent."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return {str(name): float(seconds) for name, seconds in json.load(f).items()}


def slowest_files_first(nodeids: Sequence[str], weights: dict[str, float]) -> list[int]:
    """Indices of ``nodeids`` reordered: files by descending weight (unknown files first), stable."""
    first_seen: dict[str, int] = {}
    for nodeid in nodeids:
        first_seen.setdefault(nodeid.split("::", 1)[0], len(first_seen))

    def key(index: int) -> tuple[float, int]:
        path = nodeids[index].split("::", 1)[0]
        return (-weights.get(path, math.inf), first_seen[path])

    return sorted(range(len(nodeids)), key=key)


def file_seconds(log_lines: Sequence[str]) -> dict[str, float]:
    """Per-file sums of the phase durations a ``--durations=0`` report lists."""
    totals: dict[str, float] = {}
    for line in log_lines:
        match = _DURATION_LINE.match(line.strip())
        if match:
            path = match["nodeid"].split("::", 1)[0]
            totals[path] = totals.get(path, 0.0) + float(match["seconds"])
    return totals


def main(argv: Sequence[str]) -> None:
    if len(argv) != 1:
        raise SystemExit("usage: python -m tests.file_order FULL_RUN_LOG (the output of a --durations=0 run)")
    with open(argv[0]) as f:
        totals = file_seconds(f.readlines())
    if not totals:
        raise SystemExit(f"{argv[0]} has no durations report: run the suite with --durations=0")
    with open(TABLE, "w") as f:
        json.dump({path: round(totals[path], 1) for path in sorted(totals)}, f, indent=1)
        f.write("\n")
    print(f"{TABLE}: {len(totals)} files, {sum(totals.values()):.0f} s in all")


if __name__ == "__main__":
    main(sys.argv[1:])
