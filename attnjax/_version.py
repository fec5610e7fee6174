"""attnjax's version (the verdicts of ``python -m attnjax.check`` record it)."""

__version__ = "0.1.0"
