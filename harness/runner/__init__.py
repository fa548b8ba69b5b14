"""The measuring instrument: a real training step of a Llama model under 4D parallelism.

The only package that imports torch. ``model`` knows nothing of parallelism; ``parallel/`` holds one
file per axis and the composer; ``worker`` runs one rank; ``supervisor`` runs one point.
"""
