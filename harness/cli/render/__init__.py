"""The commands' output, one module per command (``estimate``, ``plan``, ``run``, ``calibrate``) and what
they share (``common``). The only place bytes become GiB."""
