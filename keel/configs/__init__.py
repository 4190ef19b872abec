"""Config presets (TOML data files), read with importlib.resources; see keel.config."""
