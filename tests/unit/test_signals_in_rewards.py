"""A signal in training and a step's rewards (`rlcli.signals.interruptible`), in this process: rewards that
end within `REWARDS_GRACE` seconds of the signal let the step finish; rewards that hang are ended with
`StepInterrupted` once the grace has passed, or at once by a second signal."""

from __future__ import annotations

import os
import signal
import time

import pytest

from rlcli.signals import REWARDS_GRACE, TRAINING, RunSignals, StepInterrupted, interruptible


def hang_in_rewards(seconds: float) -> None:
    with interruptible():
        time.sleep(seconds)  # a reward that hangs, in the main thread


def test_rewards_that_end_in_time_finish_after_a_signal():
    with RunSignals() as signals:
        signals.phase = TRAINING
        os.kill(os.getpid(), signal.SIGTERM)
        hang_in_rewards(0.5)  # no StepInterrupted: the step finishes and saves as before
        assert signals.exit_code == 143


def test_rewards_that_hang_are_ended_after_the_grace():
    """Before the fix the sleep ran its full 60 s and nothing was raised."""
    with RunSignals() as signals:
        signals.phase = TRAINING
        os.kill(os.getpid(), signal.SIGTERM)
        started = time.monotonic()
        with pytest.raises(StepInterrupted) as caught:
            hang_in_rewards(60)
        assert REWARDS_GRACE <= time.monotonic() - started < REWARDS_GRACE + 5
        assert (caught.value.signum, caught.value.code) == (signal.SIGTERM, 143)


def test_a_second_signal_ends_the_rewards_at_once():
    with RunSignals() as signals:
        signals.phase = TRAINING
        os.kill(os.getpid(), signal.SIGINT)
        started = time.monotonic()
        with pytest.raises(StepInterrupted) as caught:
            with interruptible():
                time.sleep(0.3)
                os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C again, while the reward still runs
                time.sleep(60)
        assert time.monotonic() - started < REWARDS_GRACE
        assert (caught.value.signum, caught.value.code) == (signal.SIGINT, 130)


def test_rewards_that_swallow_the_interruption_are_ended_all_the_same():
    """The main thread is signalled until it leaves the rewards: one signal alone is lost if it lands just before
    a wait begins, or, as here, if the reward's bare ``except`` takes it (before the fix the sleep ran 60 s)."""
    swallowed = []
    with RunSignals() as signals:
        signals.phase = TRAINING
        os.kill(os.getpid(), signal.SIGINT)
        started = time.monotonic()
        with pytest.raises(StepInterrupted):
            with interruptible():
                try:
                    time.sleep(0.3)
                    os.kill(os.getpid(), signal.SIGINT)
                    time.sleep(60)
                except BaseException as err:  # noqa: BLE001 - a reward that takes everything and goes on
                    swallowed.append(type(err))
                    time.sleep(60)
        assert swallowed == [StepInterrupted]
        assert time.monotonic() - started < REWARDS_GRACE
