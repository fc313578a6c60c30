"""Downstream evaluation through lm-evaluation-harness (``llmforge eval``, ``eval.interval``).

``lm`` is llmforge's model as an lm-eval model (lm-eval imported when one is made),
``tasks`` finds, loads and runs tasks, ``results`` shows and keeps what they return.
"""
