"""``python -m compcomm.bench``: the same as ``compcomm-bench``."""

import sys

from .cli import main

sys.exit(main())
