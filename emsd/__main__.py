"""``python -m emsd`` is ``emsd``."""

import sys

from emsd.cli import main

sys.exit(main())
