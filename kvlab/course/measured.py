"""Measured checks: whether a lesson's measurement showed its effect, kept apart from whether the learner's
arithmetic on that measurement is right.

A graded timing check judges two things. The learner's numbers must be what their own measurement gives (exact, and
a wrong one fails). Whether the measurement shows the lesson's effect is the machine's business, not the learner's:
each measured lesson has a ``*_reading`` function that reads its data by criteria stated in the lesson (a fit's R²,
the effect's direction, a ratio inside a band) and returns a ``Reading``. The lesson's measurement cell calls
``retake``, which measures again while the reading is unreadable, a bounded number of times, and prints the reading;
the check reads the same data with the same function, so the cell's verdict and the check's always agree. Where the
effect stayed unseen, the check says so on stdout (never stderr, which nbgrader scores as a failure) and passes on
the arithmetic alone: noise never fails correct work, and a run that contradicts the lesson is never passed as if
it confirmed it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")

# Measurements a lesson's cell takes at most, the first included, before it says the effect was not seen. Each take
# of the lessons' sweeps costs a few CPU seconds in quick mode; three keep a whole notebook's validation within the
# time README states while letting one burst of load pass.
TAKES = 3


@dataclass(frozen=True)
class Reading:
    """What one measurement showed: ``seen`` (every criterion met), ``numbers`` (the figures the criteria were
    applied to, as one sentence), ``unmet`` (each criterion the data missed, in words) and ``takes`` (how many
    measurements were taken to get it)."""

    seen: bool
    numbers: str
    unmet: tuple[str, ...] = ()
    takes: int = 1

    @property
    def _tries(self) -> str:
        """How many measurements the verdict took, when more than one."""
        return f" (measurement {self.takes} of at most {TAKES})" if self.takes > 1 else ""

    def headline(self) -> str:
        """The verdict without the figures, for a measurement cell whose figures an exercise below asks the learner
        to compute: printing them there would give the answer away. ``str()`` of the reading, printed after the
        exercise, gives the figures and the reasons."""
        tries = self._tries
        if self.seen:
            return f"Readable{tries}; the figures are printed after the exercise that computes them."
        return (
            f"NOT READABLE{tries}: this run does not show the effect (why is printed after the exercise that "
            "computes the figures); other processes' load is the likeliest cause."
        )

    def __str__(self) -> str:
        tries = self._tries
        if self.seen:
            return f"Readable{tries}: {self.numbers}."
        return (
            f"NOT READABLE{tries}: {self.numbers}; {'; '.join(self.unmet)}. This run does not show the effect; "
            "other processes' load is the likeliest cause. Re-run the measurement cell when the machine is quieter."
        )


def reading(numbers: str, unmet: list[str]) -> Reading:
    """A ``Reading`` of ``numbers``, seen when no criterion is ``unmet``."""
    return Reading(not unmet, numbers, tuple(unmet))


def retake(measure: Callable[[], T], read: Callable[[T], Reading], takes: int = TAKES) -> tuple[T, Reading]:
    """``measure()`` until ``read`` sees the effect, ``takes`` measurements at most; the last data and its reading."""
    if takes < 1:
        raise ValueError(f"takes: {takes}; allowed: an integer >= 1")
    take = 0
    while take < takes:
        take += 1
        data = measure()
        seen = read(data)
        if seen.seen:
            break
    return data, dataclasses.replace(seen, takes=take)


def tell(effect: str, seen: Reading) -> None:
    """What a check says after the learner's arithmetic passed: nothing where the effect was seen; where it was not,
    that it was not, and that the grade does not rest on it."""
    if not seen.seen:
        print(
            f"Your numbers match your measurement: that is what is graded. The measurement itself did not show "
            f"{effect} on this run ({'; '.join(seen.unmet)}), so it does not confirm the lesson (where it went the "
            "other way, load falling unevenly on what was compared is the likeliest cause), and the grade does not "
            "depend on it. Re-run the measurement cell when the machine is quieter to see the effect."
        )
