"""Training of the tiny fixtures: a byte-level target on Python source, then a DFlash draft for it.

`python -m training` (or `make fixtures`) writes remote_worker/fixtures/; see training/__main__.py.
"""
