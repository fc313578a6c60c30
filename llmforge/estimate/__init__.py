"""Estimates of memory, pipeline bubble, FLOPs, communication and step time for a run plan.

Pure Python: nothing here imports torch except ``measure`` (``llmforge estimate
--measure``). ``core.estimate`` evaluates one layout; ``search`` ranks every valid
layout; ``report`` prints them.
"""
