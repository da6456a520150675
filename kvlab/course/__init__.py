"""The course's exercise checkers, one module per lesson, and the grading helpers they share.

- ``grading``: quick mode, each lesson's setup, and what every checker uses to call a learner's function, compare
  its answer and word the failure (``_fail``, ``_hint``, ``_close``, ``_exact_int``, ``_call``).
- ``measured``: a measured check's ``Reading`` of its data, the bounded ``retake`` a lesson's measurement cell runs
  while the data is unreadable, and ``tell``, what a check says when its effect was not seen.
- ``lesson00_orientation`` .. ``lesson10_speculative_decoding``: the checkers of one lesson each, with their cases and
  the bands they accept, each band beside the measurements it was set from.

The notebooks import every checker from ``kvlab.checks``, the index of these modules.
"""
