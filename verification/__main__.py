"""``python -m verification``: run the suite and exit with its status (1 if any check fails)."""

from .suite import main

raise SystemExit(main())
