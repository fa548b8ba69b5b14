"""``run.mode=fake``: a layout's memory traced without its devices, under FakeTensorMode and the fake
process group. ``run`` (the record), ``ranks`` (which ranks to trace), ``pool`` (tracing them side by side),
``trace`` (one rank), ``modes`` (the context managers a trace runs under), ``cache`` (traces kept across
runs), ``kernels`` (CUDA's kernels in place of the CPU's), ``ddp`` (DDP's buckets made explicit).
"""
