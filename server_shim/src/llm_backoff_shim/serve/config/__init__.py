"""The shim's settings: the model, its sources (flags, environment, TOML file) and their checks."""
