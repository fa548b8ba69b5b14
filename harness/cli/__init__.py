"""The command line: the only code that knows Hydra. ``config`` composes the YAML tree into specs,
``main`` dispatches the commands, ``help`` holds every key's meaning, ``render/`` prints each command's
output, ``emit``/``sweep``/``replay`` are the commands with more than a few lines of their own.

May import: every other layer.
"""
