"""Rank bodies and scripts run under mpirun (see tests/mpi/runner.py)."""
