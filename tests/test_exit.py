"""Exit waits for gloo's worker threads to finish releasing their work (accel.process_group.wait_for_gloo_workers).

Without it a process could abort after its script succeeded ("terminate called without an active exception"): a
gloo worker releasing a backward-pass all-reduce took the GIL while the interpreter was finalizing (1 in 30
`accel test` runs under CPU load with ACCEL_DISABLE_NATIVE=1; 0 in 45 with the wait).
"""

from __future__ import annotations

import ctypes
import threading

import pytest

from accel import process_group

PR_SET_NAME = 15


@pytest.fixture
def gloo_named_thread():
    """A thread of this process named as torch names gloo's workers, asleep on an event until the test ends."""
    named, stop = threading.Event(), threading.Event()

    def run():
        ctypes.CDLL(None).prctl(PR_SET_NAME, process_group._GLOO_WORKER.encode(), 0, 0, 0)
        named.set()
        stop.wait(30)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert named.wait(5)
    yield thread
    stop.set()
    thread.join(5)


@pytest.fixture
def gloo_threads_before():
    """The gloo worker threads this test process already has (earlier tests' DDP keeps their groups' threads)."""
    return len(process_group._gloo_worker_states())


def test_gloo_worker_states_reads_each_worker_thread(gloo_threads_before, gloo_named_thread):
    states = process_group._gloo_worker_states()
    assert len(states) == gloo_threads_before + 1 and set(states) == {"S"}  # ours asleep on its event, all idle
    assert process_group.wait_for_gloo_workers(timeout_s=1.0)


def test_no_gloo_threads_means_no_wait(monkeypatch):
    monkeypatch.setattr(process_group, "_gloo_worker_states", lambda: [])
    assert process_group.wait_for_gloo_workers(timeout_s=0.0)


def test_waits_for_three_idle_looks_in_a_row(monkeypatch):
    looks = iter([["R", "S"], ["S", "S"], ["S", "R"], ["S", "S"], ["S", "S"], ["S", "S"]])
    seen = []

    def states():
        seen.append(next(looks))
        return seen[-1]

    monkeypatch.setattr(process_group, "_gloo_worker_states", states)
    assert process_group.wait_for_gloo_workers(timeout_s=10.0)
    assert len(seen) == 6  # a busy look restarts the count


def test_a_worker_that_stays_busy_ends_the_wait_at_its_deadline(monkeypatch):
    monkeypatch.setattr(process_group, "_gloo_worker_states", lambda: ["R"])
    assert not process_group.wait_for_gloo_workers(timeout_s=0.05)

