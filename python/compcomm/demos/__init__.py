"""Runnable demonstrations (``compcomm-demo``)."""
