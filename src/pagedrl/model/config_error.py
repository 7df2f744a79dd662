"""The error a config.json that pagedrl cannot build a model from raises: its own module, so that the
families' field readers (`gemma`, `gpt_oss`, `deepseek`, `rope_fields`), which `config` imports, raise
it without importing `config` back."""


class ConfigError(ValueError):
    """A config.json that pagedrl cannot build a model from; the message names file and field."""
