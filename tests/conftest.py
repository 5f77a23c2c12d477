"""Fixtures shared by tests/: the ``backend`` x ``world`` parametrisation and the markers.

- ``backend``: one entry per backend of compcomm's registry (``compcomm.init`` names), as a
  :class:`_backends.Backend` whose ``run(world, "module:function", *args)`` runs a rank body on
  ``world`` ranks. Backends that cannot run here are skipped with the reason (not built, no
  mpirun, no GPU or not one GPU per rank).
- ``world``: paired with ``backend`` when a test takes both (W = 1..4; the local backend only
  has W=1). Without ``backend``, ``_backends.worlds`` is the W = 1, 2, 3, 4 parametrisation.
- markers ``mpi`` and ``gpu`` are applied to the backend parameters that need them.

The tests/ folder is put on ``sys.path`` here, so helper modules (``reference``, ``_backends``,
``_*_cases``) import the same way from tests/, its sub-folders and spawned ranks (which inherit
``sys.path``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_TESTS = str(Path(__file__).resolve().parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

import _backends  # noqa: E402  (needs the path above)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "conformance: the collective conformance suite (tests/conformance)")


def _backend_params(with_world: bool) -> list:
    """One pytest.param per backend (x world): skipped with the reason where it cannot run here."""
    params = []
    for b in _backends.backends():
        marks = [getattr(pytest.mark, m) for m in b.marks]
        for w in b.worlds if with_world else b.worlds[:1]:
            why = b.skip(w)
            m = marks + ([pytest.mark.skip(reason=f"{b.name}: {why}")] if why else [])
            if with_world:
                params.append(pytest.param(b, w, id=f"{b.name}-W{w}", marks=m))
            else:
                params.append(pytest.param(b, id=b.name, marks=m))
    return params


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A test taking ``backend`` runs once per registered backend; taking ``backend`` and
    ``world``, once per (backend, world size) pair that backend has."""
    if "backend" not in metafunc.fixturenames:
        return
    if "world" in metafunc.fixturenames:
        metafunc.parametrize(("backend", "world"), _backend_params(True))
    else:
        metafunc.parametrize("backend", _backend_params(False))
