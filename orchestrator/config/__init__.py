"""The bottom layer, importing nothing of the orchestrator's: the typed settings (`settings`), their checks with
one-line errors (`validation`), secrets kept out of every record (`redaction`), prompt sets (`prompts`) and
the checkout's paths (`paths`)."""
