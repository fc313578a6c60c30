"""What each command does once its arguments are parsed: one module per command group.

``llmforge.cli`` declares the Typer commands and hands over to these functions; every
one of them starts from a RunPlan (composed from a recipe and overrides, or read back
from a run's plan.json or a checkpoint). Nothing heavy is imported at start-up.
"""
