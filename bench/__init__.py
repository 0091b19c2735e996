"""Benchmarks: `make bench` (or `python -m bench [name ...]`). Not part of `make test`."""
