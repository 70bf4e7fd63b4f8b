"""Beyond one process: tensor parallelism over torch.distributed (gloo on CPU).

- :mod:`pagedkv.distributed.group`: the process groups (compute all-reduces, step broadcast);
- :mod:`pagedkv.distributed.executor`: rank 0's runner, which starts the other ranks;
- :mod:`pagedkv.distributed.worker`: ranks 1..N-1.

What each rank holds is :mod:`pagedkv.model.partition`'s.
"""
