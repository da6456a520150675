"""The course's exercise checkers, one module per lesson, and the grading helpers they share.

- ``grading``: quick mode, each lesson's setup, and what every checker uses to call a learner's function, compare
  its answer and word the failure (``_fail``, ``_hint``, ``_close``, ``_exact_int``, ``_call``), and to measure
  again before a timing is judged (``_measure_again``).
- ``lesson00_orientation`` .. ``lesson10_speculative_decoding``: the checkers of one lesson each, with their cases and
  the bands they accept, each band beside the measurements it was set from.

The notebooks import every checker from ``kvlab.checks``, the index of these modules.
"""
