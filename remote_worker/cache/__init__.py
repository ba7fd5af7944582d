"""The hybrid-aware cache: exact tree verification and commit for full-attention and Gated DeltaNet layers."""
