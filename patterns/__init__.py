"""Pattern types and the recognizer (installed as `ucp.patterns`)."""
from ucp.patterns.recognize import FragmentInfo, Hints, OuterPiece, recognize, recognize_nested
from ucp.patterns.types import Pattern, PatternSpec

__all__ = ["FragmentInfo", "Hints", "OuterPiece", "Pattern", "PatternSpec", "recognize", "recognize_nested"]
