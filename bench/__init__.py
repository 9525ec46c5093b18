"""Benchmarks, one module per subsystem: `python -m bench.<name>`."""
