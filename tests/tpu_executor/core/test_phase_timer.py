"""The phase timer: sums and counts per phase, nesting per thread, device phases synchronised."""
import threading
import time

import pytest

from tpu_executor.core.phase_timer import PhaseTimer


def test_sums_counts_and_nesting():
    timer = PhaseTimer()
    with timer.phase("schedule"):
        assert timer.active == ["schedule"]
        with timer.phase("inputs"):
            assert timer.active == ["schedule", "inputs"]
            time.sleep(0.01)
    with timer.phase("inputs"):
        pass
    assert timer.active == []
    assert timer.calls == {"schedule": 1, "inputs": 2}
    assert timer.seconds["schedule"] >= 0.01 and timer.seconds["inputs"] >= 0.01
    timer.reset()
    assert timer.seconds == {} and timer.calls == {}


def test_each_thread_has_its_own_open_phases():
    timer = PhaseTimer()
    seen = []
    with timer.phase("output"):
        thread = threading.Thread(target=lambda: seen.append(list(timer.active)))
        thread.start()
        thread.join()
    assert seen == [[]]


def test_device_phases_wait_for_the_device_unless_they_failed():
    waits = []
    timer = PhaseTimer(synchronize=lambda: waits.append(timer.active[-1]))
    with timer.phase("decode"):
        pass
    with timer.phase("inputs"):
        pass
    with pytest.raises(RuntimeError):
        with timer.phase("sample"):
            raise RuntimeError("step failed")
    assert waits == ["decode"]  # a failed call is not waited for, a host phase never
    assert timer.calls == {"decode": 1, "inputs": 1, "sample": 1} and timer.active == []
