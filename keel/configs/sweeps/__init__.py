"""Sweep presets for `keel sweep --preset NAME` (TOML data files)."""
