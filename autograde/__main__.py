import sys

from autograde.lean import skip_unused_imports

skip_unused_imports()

from autograde.cli import main  # noqa: E402 (after the import it replaces)

sys.exit(main())
