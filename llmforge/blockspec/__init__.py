"""One description of a transformer block (``block``), its numbers (``dims``) and what its
ops cost (``costs``); torch-free, below both ``llmforge.models`` and ``llmforge.estimate``."""
