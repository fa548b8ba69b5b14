"""The command line: the only code that knows Hydra. ``config`` composes the YAML tree into specs,
``main`` dispatches the commands, ``results`` holds those that read a results_dir, ``help`` every
key's meaning, ``render/`` each command's output; ``emit``, ``sweep`` and ``replay`` are the commands
with more than a few lines of their own.

May import: every other layer.
"""
