"""Run one rank body under mpirun, mpi4py-style: ``mpirun -np N python runner.py module:function
'[json args]'`` calls ``function(ctx, *args)`` on ``compcomm.init("mpi")`` (a size-1 communicator
at N=1, the world at N>1), with ``module`` imported from tests/.

A failing body raises: the rank prints its traceback on stderr (prefixed with its rank) and exits
non-zero, so mpirun ends the job and the test shows that traceback. Nothing is printed on success.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/

import _backends  # noqa: E402
import compcomm  # noqa: E402


def main(argv: list) -> int:
    ref = argv[1]
    args = json.loads(argv[2]) if len(argv) > 2 else []
    comm = compcomm.init("mpi")
    try:
        _backends.resolve_body(ref)(_backends.Ctx(comm), *args)
    except BaseException:
        sys.stderr.write(f"--- {ref} failed on MPI rank {comm.rank()} of {comm.size()} ---\n"
                         + traceback.format_exc())
        sys.stderr.flush()
        return 1
    finally:
        compcomm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
