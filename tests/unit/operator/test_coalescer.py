"""Coalescer: one run per burst of requests for a key (the latest function), never two of a key at once."""

import threading

from keepwarm_operator.handlers.setup import Coalescer

WAIT_S = 30.0  # a safety net for a broken implementation, not a timing assertion


def test_a_burst_for_one_key_runs_once_with_the_latest_function():
    ran: list[str] = []
    later = threading.Event()
    c = Coalescer(delay_s=0.05, workers=1)  # one worker: "later" runs after the burst's run ends
    for i in range(5):
        c.submit("k", lambda i=i: ran.append(f"fn{i}"))
    c.submit("later", later.set)  # due after the burst's one run
    assert later.wait(WAIT_S)
    assert ran == ["fn4"]


def test_a_key_asked_for_while_it_runs_runs_again_after_not_beside():
    release, first_started, second_done = threading.Event(), threading.Event(), threading.Event()
    running = 0
    overlap: list[int] = []
    lock = threading.Lock()

    def body(started: threading.Event | None, finished: threading.Event | None) -> None:
        nonlocal running
        with lock:
            running += 1
            overlap.append(running)
        if started is not None:
            started.set()
            release.wait(WAIT_S)
        with lock:
            running -= 1
        if finished is not None:
            finished.set()

    c = Coalescer(delay_s=0.0, workers=4)
    c.submit("k", lambda: body(first_started, None))
    assert first_started.wait(WAIT_S)
    c.submit("k", lambda: body(None, second_done))  # pending while the first still runs
    assert not second_done.wait(0.2)  # not started beside the first (4 free workers notwithstanding)
    release.set()
    assert second_done.wait(WAIT_S)
    assert overlap == [1, 1]
