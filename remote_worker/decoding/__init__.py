"""Decoding: tree building and the AR / DFlash / DDTree loops over the hybrid-aware cache."""
