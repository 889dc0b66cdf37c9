"""The slowest-file-first order of the suite (tests/file_order.py), on hand-worked examples."""

from __future__ import annotations

import os

import pytest

from tests.file_order import TABLE, file_seconds, load_weights, slowest_files_first

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NODEIDS = [
    "tests/a.py::test_1",  # 0
    "tests/a.py::test_2",  # 1
    "tests/b.py::test_1",  # 2
    "tests/c.py::test_1",  # 3
    "tests/c.py::test_2[x]",  # 4
    "tests/c.py::test_2[y]",  # 5
    "tests/d.py::test_1",  # 6
    "tests/e.py::test_1",  # 7
]


def test_files_run_slowest_first_with_unknown_files_first_and_each_file_contiguous_in_order():
    weights = {"tests/a.py": 1.0, "tests/c.py": 50.0, "tests/d.py": 1.0, "tests/e.py": 3.0}
    order = slowest_files_first(NODEIDS, weights)
    # b (unknown) first, then c (50 s), e (3 s), then a and d (1 s each) in their collected order
    assert order == [2, 3, 4, 5, 7, 0, 1, 6]
    assert sorted(order) == list(range(len(NODEIDS)))


def test_without_weights_the_collected_order_stands():
    assert slowest_files_first(NODEIDS, {}) == list(range(len(NODEIDS)))


def test_file_seconds_sums_every_phase_of_a_durations_report():
    log = [
        "============================= slowest durations =============================",
        "385.21s setup    tests/c.py::test_2[x]",
        "12.50s call     tests/c.py::test_2[y]",
        "0.30s teardown tests/a.py::test_1",
        "2335 passed, 1 skipped in 2191.67s (0:36:31)",
        "(12 durations < 0.005s hidden.  Use -vv to show these durations.)",
    ]
    assert file_seconds(log) == pytest.approx({"tests/c.py": 397.71, "tests/a.py": 0.3})


def test_every_file_in_the_table_exists():
    """A renamed or deleted file leaves a stale row: regenerate the table (tests/file_order.py)."""
    missing = [path for path in load_weights(TABLE) if not os.path.exists(os.path.join(REPO_ROOT, path))]
    assert not missing, f"tests/file_durations.json names missing files {missing}: python -m tests.file_order LOG"


def test_this_session_collected_the_slowest_files_first(request):
    weights = load_weights(TABLE)
    files = list(dict.fromkeys(item.nodeid.split("::", 1)[0] for item in request.session.items))
    known = [weights[path] for path in files if path in weights]
    assert known == sorted(known, reverse=True)
    assert getattr(request.config.option, "loadscopereorder", False) is False
