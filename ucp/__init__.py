"""ucp: universal checkpoints for DeepSpeed."""
__version__ = "0.1.0"
