"""Target (and later draft) models: building tiny ones from configs, loading real checkpoints."""
