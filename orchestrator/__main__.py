"""`python -m orchestrator [overrides]`: see orchestrator.cli."""

from orchestrator.cli import main

main()
