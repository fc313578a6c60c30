"""Estimates of memory, pipeline bubble, FLOPs, communication and step time for a run plan.

Arithmetic only: nothing here imports torch or the code that runs models (``llmforge
estimate --measure`` is ``llmforge.train.measure``). ``core.estimate`` evaluates one
layout; ``search`` ranks every valid layout; ``report`` builds the JSON objects and
``text`` the words (the command and its tables are ``llmforge.commands``).
"""
