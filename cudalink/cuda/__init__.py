"""All cuda.core / cuda.bindings glue, including every use of their private modules.

It imports nothing of cudalink above :mod:`cudalink.errors` and :mod:`cudalink._native`, so frames,
transports and the link stand on it and it never reaches back:

- :mod:`.driver`: loading the CUDA packages, driver calls, events and streams (the per-frame calls);
- :mod:`.arrays`: any array as a pointer plus layout, with no copy; the views CUDA frames export;
- :mod:`.devices`: ``device=`` parsing, GPUs by ordinal or UUID, IPC support;
- :mod:`.memory`: slot memory, exported and mapped (cuda.core IPC pool or legacy cuIpc handles).
"""
