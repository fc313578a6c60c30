from llmforge.cli import main

main()
