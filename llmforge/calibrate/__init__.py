"""``llmforge calibrate``: measure this machine and write a hardware profile.

The torch side of the hardware profiles (``llmforge.hardware`` reads them without
torch): ``compute`` times matmuls, fused attention, memory-bound kernels and the
launch floor on one device; ``collectives`` times all_reduce, all_gather,
reduce_scatter, all_to_all and send/recv over several ranks (``worker`` is what
torchrun starts on each); ``fit`` turns the timings into the profile's keys; ``trust``
and ``probe`` judge whether a busy machine disturbed them; ``lock`` keeps calibrations
one at a time; ``write`` writes the YAML with its provenance; ``auto`` runs the quick
calibration before the first CPU run on a machine; ``advice`` is what a run's closing
line says when its profile looks wrong.
"""
