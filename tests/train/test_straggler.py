"""The busy clock that straggler detection reads: host time, and CUDA events on a GPU (read once
the device has passed them, without a sync until the log point)."""

import time

import pytest
import torch

from kiln.train.straggler import BusyClock


def test_the_clock_sums_its_blocks_and_starts_again_when_taken():
    clock = BusyClock(torch.device("cpu"))
    with clock.host():
        time.sleep(0.05)
    with clock.device():  # the host's clock too, on the CPU
        time.sleep(0.05)
    time.sleep(0.05)  # outside any block: not this rank's work
    assert 0.1 <= clock.take() < 0.15
    assert clock.take() == 0.0


@pytest.mark.gpu
def test_on_a_gpu_the_forward_is_timed_by_the_device():
    clock = BusyClock(torch.device("cuda"))
    x = torch.randn(4096, 4096, device="cuda")
    for _ in range(3):
        with clock.device():
            torch.cuda._sleep(50_000_000)  # device work the host does not wait for
            x @ x
    host_started = time.perf_counter()
    torch.cuda.synchronize()
    waited = time.perf_counter() - host_started
    seconds = clock.take()
    assert seconds > 0 and seconds >= 0.5 * waited  # the device's time, not the launches'
