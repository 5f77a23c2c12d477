"""The conformance suite: one body per collective, run on every backend (tests/_backends.py)."""
