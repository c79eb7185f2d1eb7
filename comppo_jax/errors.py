"""The configuration error every layer raises, kept below all of them (the path layer and the hub
resolve user paths before any model exists)."""


class ConfigError(ValueError):
    """A configuration field (a model's or a run's) is missing, malformed or unsupported; the
    message names the field and the fix."""
