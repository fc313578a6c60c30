"""Bodies of the CLI's commands: they take a built plan and print; ``llmforge.cli`` parses."""
