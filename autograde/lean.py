"""Start-up cost that the grading commands never use.

Importing nbformat imports jsonschema, and jsonschema imports ``rfc3987_syntax`` when it is installed (a dependency
of jupyter-events) to check the "iri" string format: that package compiles a grammar at import, several seconds of
CPU, paid by every command and every nbgrader run. No schema nbformat or nbgrader validates uses that format, so the
commands tell Python the package is absent (jsonschema then skips that one format checker).
"""

import sys


def skip_unused_imports() -> None:
    sys.modules.setdefault("rfc3987_syntax", None)  # type: ignore[arg-type]  (None makes `import` raise ImportError)
