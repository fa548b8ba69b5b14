"""The command line: the only code that knows Hydra."""
