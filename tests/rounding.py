"""The rounding bound the tests hold the cache to: the worker's own (`remote_worker.models.rounding`), which
the probe reports beside what it measures, so tests and probe judge by one model of the arithmetic."""

from remote_worker.models.rounding import LAMBDA, longest_reduction, model_bound, own_forward_bound, rounding_bound

__all__ = ["LAMBDA", "longest_reduction", "model_bound", "own_forward_bound", "rounding_bound"]
