"""Probes: answers about the host, the model and its cache that a researcher otherwise finds out by hand."""
