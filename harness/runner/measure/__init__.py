"""Peak memory per rank, measured the same way every time and labelled with its method: ``peak`` (the
context manager a step runs under), ``tracker`` (MemTracker's categories), ``cpu`` (the CPU allocator's
own running total) and ``trace`` (the step as an allocation trace, replayed through harness.alloc).
"""
