"""Stability diagnostics: the divergence classifier and the gradient-flow profile."""
