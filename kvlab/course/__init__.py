"""The course's checkers, one module per lesson (learners import them through ``kvlab.checks``); what the checkers
share (``grading``: calling, comparing and wording; ``measured``: measuring again until a timing is readable); and
the capstone incident (``incident``: a chat service's trace replayed at scale and the fixes a team can ship, its
replays kept across a grader's kernels by ``disk_memo``)."""

from kvlab._lazy import lazy_exports

# public name -> the module that defines it
_EXPORTS: dict[str, str] = {
    "Fix": "kvlab.course.incident",
    "INCIDENT": "kvlab.course.incident",
    "PUBLIC_SEEDS": "kvlab.course.incident",
    "SCALE": "kvlab.course.incident",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
