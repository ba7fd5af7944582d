"""MLflow: creating the job's run, applying the worker's events to it, finishing it."""
