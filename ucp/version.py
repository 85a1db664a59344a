"""The version of ucp, recorded in every index it writes (`created_by`)."""
__version__ = "0.1.0"
