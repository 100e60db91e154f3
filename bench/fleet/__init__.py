"""`vivant bench fleet`: the control plane measured at fleet scale (see run.py)."""
