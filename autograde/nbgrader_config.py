"""nbgrader configuration for the kvlab course. The course root is the repository root (this file's parent's
parent), so a copy of the repository grades itself with no edits. Run it through ``python -m autograde``, which
passes this file to nbgrader and sets up the kernel's environment (see README.md)."""

import os

c = get_config()  # noqa: F821 (traitlets defines get_config when it loads this file)

root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

c.CourseDirectory.root = root
c.CourseDirectory.course_id = "kvlab"
c.CourseDirectory.source_directory = "solutions"
c.CourseDirectory.release_directory = "lessons"
c.CourseDirectory.submitted_directory = "autograde/submitted"
c.CourseDirectory.autograded_directory = "autograde/autograded"
c.CourseDirectory.feedback_directory = "autograde/feedback"
c.CourseDirectory.db_url = "sqlite:///" + os.path.join(root, "autograde", "gradebook.db")

# A student who deletes a test cell still has the answer graded: nbgrader puts the released cell back (after the
# answer cell before it) instead of scoring it 0 with no grade. nbgrader restores only graded cells this way.
c.OverwriteCells.add_missing_cells = True

# Grading runs every notebook in quick mode (NBGRADER_EXECUTION is set); its slowest cell takes seconds, so a cell
# that needs minutes has hung.
c.Execute.timeout = 300
# Every kernel would log that its localhost TCP ports are unencrypted, once per notebook graded; its other warnings
# are about the kernel, not the student's code (whose warnings are cell output, unaffected).
c.Execute.extra_arguments = ["--IPKernelApp.log_level=ERROR"]

# nbgrader gives a test cell zero when it writes anything to stderr. The lessons filter warnings in their setup
# cell; this drops any stray warning or progress bar that still reaches stderr (from C++ code, for instance).
c.IgnorePattern.enabled = True
c.IgnorePattern.pattern = r"Warning|warn\(|\d+%\|"

# Feedback shows the autograded notebook: hidden test code must not appear in it.
c.GenerateFeedback.preprocessors = [
    "nbgrader.preprocessors.GetGrades",
    "nbconvert.preprocessors.CSSHTMLHeaderPreprocessor",
    "nbgrader.preprocessors.ClearHiddenTests",
]
