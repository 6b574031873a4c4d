import sys

from pcpviz.cli import main

sys.exit(main())
