"""Experiment drivers built on ``keel train``: stress tests, sweeps, ablations."""
