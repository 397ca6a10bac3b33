"""Exception types of v4engine: every user-facing failure is one of these, with a one-line message."""


class V4EngineError(Exception):
    """Base class: a message that names the file, tensor, field or request at fault."""


class ConfigError(V4EngineError):
    """config.json (or the model config inside engine.json) is missing a field or holds an impossible value."""
