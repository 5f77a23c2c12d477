"""``compcomm-demo``: the project's runnable demonstrations.

``compcomm-demo allreduce [...]`` compresses and all-reduces a large tensor on W CPU ranks.
"""

from __future__ import annotations

import sys
from typing import List, Optional


def main(argv: Optional[List[str]] = None) -> int:
    """Dispatch to a demo; ``compcomm-demo allreduce --help`` lists its options."""
    argv = list(sys.argv[1:] if argv is None else argv)
    from .demos import allreduce

    if argv and argv[0] == "allreduce":
        argv = argv[1:]
    return allreduce.main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
