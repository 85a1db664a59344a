"""Test support: real DeepSpeed (CPU) checkpoints from a tiny model, and DeepSpeed's reference tools.

Importable as ``support``: pytest's ``pythonpath`` (setup.cfg) puts ``tests/`` on the path.
"""
