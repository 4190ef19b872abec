"""Study presets for `keel study NAME` (TOML data files, see keel.experiments.study)."""
