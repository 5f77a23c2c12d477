"""Run one rank body under mpirun, mpi4py-style: ``mpirun -np N python runner.py module:function
'[json args]'`` calls ``function(ctx, *args)`` on ``compcomm.init("mpi")`` (a size-1 communicator
at N=1, the world at N>1), with ``module`` imported from tests/.

A failing body raises: the rank prints its traceback on stderr (under a "--- ... failed on MPI
rank r" line) and exits at once with status 1 without MPI_Finalize, so mpirun ends the whole job
instead of leaving the other ranks to time out in their next collective; the test shows that
traceback first. Nothing is printed on success.
"""

from __future__ import annotations

import json
import os
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
                         + traceback.format_exc() + "--- end of rank's traceback ---\n")
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(1)  # no MPI_Finalize: mpirun aborts the job, the peers do not wait for us
    compcomm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
