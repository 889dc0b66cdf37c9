"""The worker group's rendezvous port is drawn from outside the kernel's ephemeral range (where any
outgoing connection may take it before rank 0 binds it), and is free when drawn."""

from __future__ import annotations

import random
import socket

from verl_balance.single_controller import rendezvous_port
from verl_balance.single_controller.rendezvous_port import LOWEST_PORT, ephemeral_port_range, free_rendezvous_port


def test_the_port_is_below_the_ephemeral_range_and_bindable():
    low, _ = ephemeral_port_range()
    for seed in range(20):
        port = free_rendezvous_port(rng=random.Random(seed))
        assert LOWEST_PORT <= port < low
        with socket.socket() as sock:
            sock.bind(("", port))  # free: binding it again here succeeds


def test_the_kernels_own_choice_is_in_the_ephemeral_range():
    """Negative control: what bind(0) gives (the old choice) is where outgoing connections draw from."""
    low, high = ephemeral_port_range()
    with socket.socket() as sock:
        sock.bind(("", 0))
        assert low <= sock.getsockname()[1] <= high


def test_a_taken_port_is_skipped(monkeypatch):
    draws = iter([25000, 25001])
    monkeypatch.setattr(random.Random, "randint", lambda self, a, b: next(draws))
    monkeypatch.setattr(rendezvous_port, "_bindable", lambda port: port != 25000)
    assert free_rendezvous_port(rng=random.Random(0)) == 25001


def test_the_range_file_is_read_and_a_missing_one_gives_linuxs_default(tmp_path):
    path = tmp_path / "ip_local_port_range"
    path.write_text("40000\t50000\n")
    assert ephemeral_port_range(str(path)) == (40000, 50000)
    assert ephemeral_port_range(str(tmp_path / "absent")) == (32768, 60999)
