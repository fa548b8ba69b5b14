"""The measuring instrument: a real training step of a Llama model under 4D parallelism.

The only package that imports torch. ``model`` knows nothing of parallelism; ``parallel/`` holds one file
per axis and the composer; ``worker`` runs one rank, ``supervisor`` one point (``procs``: the processes,
``outcome``: the point's record from its ranks' reports); ``measure/`` measures a rank's peak; ``record``
is the typed row a run returns; ``fake/`` traces a layout without its devices; ``dryrun`` one rank of it.

May import: harness.spec, harness.estimate (the record's ``est_*`` fields), harness.alloc.
"""
