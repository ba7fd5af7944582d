"""Hydra looks for launchers only in the `hydra_plugins` namespace: the orchestrator's own live here."""
