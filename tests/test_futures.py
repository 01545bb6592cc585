"""api_clients/futures.py: an AppendFuture behaves as a concurrent.futures.Future whatever the
order of waiting and settling, and costs the garbage collector one object until observed."""

from __future__ import annotations

import concurrent.futures
import gc
import threading

import pytest

from api_clients.futures import AppendFuture

pytestmark = pytest.mark.unit


def test_an_unobserved_future_is_one_tracked_object() -> None:
    before = len(gc.get_objects())
    futures: list[AppendFuture[int]] = [AppendFuture() for _ in range(10_000)]
    assert len(gc.get_objects()) - before <= 10_100  # a plain Future: ~11 each
    for number, future in enumerate(futures):
        future.set_result(number)
    assert [future.result() for future in futures] == list(range(10_000))


def test_result_exception_and_callbacks_before_and_after_settling() -> None:
    settled_first: AppendFuture[int] = AppendFuture()
    settled_first.set_result(3)
    assert settled_first.done()
    assert settled_first.result(timeout=0) == 3
    seen: list[int] = []
    settled_first.add_done_callback(lambda future: seen.append(future.result()))
    waited_first: AppendFuture[int] = AppendFuture()
    waited_first.add_done_callback(lambda future: seen.append(future.result()))
    waited_first.set_result(4)
    assert seen == [3, 4]
    failed: AppendFuture[int] = AppendFuture()
    failed.set_exception(ValueError("refused"))
    with pytest.raises(ValueError, match="refused"):
        failed.result()
    assert isinstance(failed.exception(), ValueError)


def test_a_second_settle_is_refused_as_by_future() -> None:
    for observe in (False, True):
        future: AppendFuture[int] = AppendFuture()
        if observe:
            future.add_done_callback(lambda _: None)
        future.set_result(1)
        with pytest.raises(concurrent.futures.InvalidStateError):
            future.set_result(2)
        with pytest.raises(concurrent.futures.InvalidStateError):
            future.set_exception(ValueError())


def test_cancel_wait_and_as_completed() -> None:
    cancelled: AppendFuture[int] = AppendFuture()
    assert cancelled.cancel()
    assert cancelled.cancelled()
    futures: list[AppendFuture[int]] = [AppendFuture() for _ in range(5)]

    def settle_all() -> None:
        for number, future in enumerate(futures):
            future.set_result(number)

    timer = threading.Timer(0.05, settle_all)
    timer.start()
    done = sorted(f.result() for f in concurrent.futures.as_completed(futures, timeout=10))
    assert done == [0, 1, 2, 3, 4]
    more: list[AppendFuture[int]] = [AppendFuture() for _ in range(3)]
    threading.Timer(0.05, lambda: more[1].set_exception(KeyError("k"))).start()
    finished, _ = concurrent.futures.wait(
        more, timeout=10, return_when=concurrent.futures.FIRST_EXCEPTION
    )
    assert finished == {more[1]}
    timer.join()


def test_no_waiter_is_lost_when_waiting_and_settling_race() -> None:
    """A waiter that makes the Condition while another thread settles: either the settle
    notifies through it, or the waiter sees the result first. 2,000 races, none may hang."""
    for round_number in range(2_000):
        future: AppendFuture[int] = AppendFuture()
        start = threading.Barrier(2)
        got: list[int] = []

        def wait(
            future: AppendFuture[int] = future,
            start: threading.Barrier = start,
            got: list[int] = got,
        ) -> None:
            start.wait()
            got.append(future.result(timeout=10))

        waiter = threading.Thread(target=wait)
        waiter.start()
        start.wait()
        future.set_result(round_number)
        waiter.join(timeout=15)
        assert got == [round_number]
