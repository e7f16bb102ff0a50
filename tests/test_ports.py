"""tests/ports.py: a port for a test's server, from a slice below the kernel's ephemeral range per pytest worker."""

import socket

from tests import ports


def test_each_worker_has_its_own_slice_below_the_ephemeral_range(monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    slices = []
    for worker in ("gw0", "gw1"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        slices.append(ports._slice())
    (first0, end0), (first1, end1) = slices
    ephemeral_low = int(ports.EPHEMERAL_RANGE.read_text().split()[0]) if ports.EPHEMERAL_RANGE.exists() else 32_768
    assert ports.LOWEST == first0 < end0 <= first1 < end1 <= ephemeral_low


def test_the_port_is_free_and_in_this_workers_slice():
    first, end = ports._slice()
    port = ports.free_port()
    assert first <= port < end or end - first < 16
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))  # nothing holds it


def test_a_taken_port_is_not_given(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        monkeypatch.setattr(ports, "_slice", lambda: (port, port + 16))
        assert ports.free_port() != port
