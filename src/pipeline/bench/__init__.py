"""Benchmarks, one module per subsystem: `python -m pipeline.bench.<name>`."""
