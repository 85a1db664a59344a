"""Pattern types and the recognizer (installed as `ucp.patterns`)."""
from ucp.patterns.recognize import FragmentInfo, Hints, recognize
from ucp.patterns.types import Pattern, PatternSpec

__all__ = ["FragmentInfo", "Hints", "Pattern", "PatternSpec", "recognize"]
