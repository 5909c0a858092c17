"""Error types that callers are expected to catch; everything else is a bug."""

from __future__ import annotations


class HeadstartError(Exception):
    """Base class of every error headstart raises on purpose."""


class ConfigError(HeadstartError):
    """A checkpoint's configuration is missing a field or holds an invalid value.

    Always names the field (dotted path, e.g. ``text_config.num_attention_heads``) and the file.
    """

    def __init__(self, field: str, file: str, problem: str) -> None:
        self.field = field
        self.file = file
        self.problem = problem
        super().__init__(f"{file}: field '{field}': {problem}")


class CheckpointError(HeadstartError):
    """A checkpoint's files are missing, truncated, or do not match its configuration."""
