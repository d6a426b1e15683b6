"""``python -m svtoolkit``: the command line (see :mod:`svtoolkit.cli`)."""

import sys

from .cli import main

sys.exit(main())
