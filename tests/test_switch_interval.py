"""Python's switch interval while background work holds the GIL (async_cosyvoice/switch_interval.py):
shortened inside, restored by the last holder out, across nesting and threads."""
from __future__ import annotations

import sys
import threading

import pytest

from async_cosyvoice.switch_interval import shortened_switch_interval


@pytest.fixture(autouse=True)
def own_interval():
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    yield
    sys.setswitchinterval(before)


def test_shortened_inside_and_restored_after():
    with shortened_switch_interval(0.0005):
        inside = sys.getswitchinterval()
    assert inside == pytest.approx(0.0005) and sys.getswitchinterval() == pytest.approx(0.005)


def test_restored_after_an_error_inside():
    with pytest.raises(RuntimeError), shortened_switch_interval(0.001):
        raise RuntimeError("a capture failed")
    assert sys.getswitchinterval() == pytest.approx(0.005)


def test_none_changes_nothing_and_a_longer_ask_never_lengthens_it():
    with shortened_switch_interval(None):
        assert sys.getswitchinterval() == pytest.approx(0.005)
    with shortened_switch_interval(0.05):
        assert sys.getswitchinterval() == pytest.approx(0.005)


def test_overlapping_holders_keep_the_smallest_until_the_last_leaves():
    """Two devices' capture threads in one process: the first out must not restore Python's
    interval under the second."""
    entered, leave = threading.Barrier(2), threading.Event()
    seen = []

    def holder():
        with shortened_switch_interval(0.002):
            entered.wait(10)
            assert leave.wait(10)

    other = threading.Thread(target=holder)
    other.start()
    with shortened_switch_interval(0.0005):
        entered.wait(10)
        seen.append(sys.getswitchinterval())
    seen.append(sys.getswitchinterval())  # the other holder is still inside
    leave.set()
    other.join(10)
    seen.append(sys.getswitchinterval())
    assert seen == pytest.approx([0.0005, 0.002, 0.005])


def test_a_non_positive_interval_is_refused():
    with pytest.raises(ValueError, match="> 0"), shortened_switch_interval(0):
        pass
    assert sys.getswitchinterval() == pytest.approx(0.005)
