"""Hydra sweeper plugin of harness (a namespace package: there is no hydra_plugins/__init__.py)."""
