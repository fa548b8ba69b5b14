"""One file per parallelism axis, and ``compose`` that applies them in a fixed, written order."""
