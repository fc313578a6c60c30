"""Code the tests and benchmarks run, kept out of the training path: the equivalence
harness (``python -m llmforge.testing.harness``) trains several layouts of a tiny
model in one started process group."""
