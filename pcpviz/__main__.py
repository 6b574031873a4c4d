"""``python -m pcpviz ...`` is the ``pcpviz`` command."""

import sys

from pcpviz.cli import main

sys.exit(main())
