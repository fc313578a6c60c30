"""Estimates of memory, pipeline bubble, FLOPs, communication and step time for a run plan.

Arithmetic only: nothing here imports torch or the code that runs models (``llmforge
estimate --measure`` is ``llmforge.train.measure``). ``core.estimate`` evaluates one
layout, from its ``inventory`` (what each pipeline rank holds, built once); ``search``
ranks every valid layout; ``report`` builds the JSON objects and ``text`` the words (the
command and its tables are ``llmforge.commands``). Nothing here reads a file: the command
passes in what the estimate needs from disk (the prepared data's document lengths).
"""
