"""Remote side of the orchestrator: runs one experiment from a spec file and writes an event log.

Imports only the standard library, torch, transformers, safetensors and numpy, so that it runs in the
remote host's own environment. It never imports `orchestrator`.
"""
