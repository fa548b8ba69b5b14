"""harness: which 4D-parallel training configuration fits in memory, and which runs fastest."""

__version__ = "0.1.0"
