"""``python -m autograde.nbgrader_run ARGS``: nbgrader's own command line (``python -m nbgrader ARGS``), started
without the imports it never uses (autograde.lean)."""

import sys

from autograde.lean import skip_unused_imports

skip_unused_imports()

from nbgrader.apps.nbgraderapp import main  # noqa: E402 (after the import it replaces)

sys.exit(main())
