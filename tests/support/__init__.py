"""Test support: real DeepSpeed (CPU) checkpoints from a tiny model, and DeepSpeed's reference tools.

Importable as ``support`` (tests/conftest.py puts ``tests/`` on ``sys.path``).
"""
