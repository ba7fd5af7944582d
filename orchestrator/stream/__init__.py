"""The worker's events on their way to MLflow: parsed (`events`), mirrored to a local file first (`mirror`),
applied exactly once (`sink`), with the position reached saved after every batch (`state`)."""
