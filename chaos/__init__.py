"""Fault scenarios, each runnable by hand (`python -m chaos.<name>`), each ending in one verdict line."""
