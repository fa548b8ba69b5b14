"""`python -m harness <command> [key=value ...]`."""

from harness.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
