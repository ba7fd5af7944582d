"""`python -m orchestrator [overrides]`: see orchestrator.cli.main."""

from orchestrator.cli.main import main

main()
