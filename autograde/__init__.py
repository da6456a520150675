"""Instructor side of the kvlab course: nbgrader configuration, hidden checks, the grading commands.

Run ``python -m autograde --help`` from the repository root; README.md here documents every command.
"""

from pathlib import Path

COURSE_ROOT = Path(__file__).resolve().parent.parent
