"""lmkit-llguidance: a structured-output backend for lmkit built on llguidance."""

__version__ = "0.1.0"
