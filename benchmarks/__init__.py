"""Benchmarks for ucp (run as scripts, e.g. `python benchmarks/convert.py`; see benchmarks/README.md)."""
