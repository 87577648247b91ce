"""Exception types for user and plugin input. Each message says what was asked,
what exists, and how to fix it."""

from __future__ import annotations


class LMKitError(Exception):
    """Base class of every error lmkit raises on purpose.

    The CLI prints these as one paragraph, without a traceback, and exits with
    :attr:`exit_code`: 2 for a problem with what the user asked for (configuration,
    plugins, model names, requests), 1 for a failure while running.
    """

    exit_code = 2


class ConfigError(LMKitError, ValueError):
    """A configuration value (file, environment, CLI flag) is invalid."""


class PluginError(LMKitError):
    """A plugin failed to load, registered something invalid, or is incompatible."""


class PluginLoadError(PluginError):
    """A plugin named explicitly (``-p NAME`` or ``LMKIT_PLUGINS``) could not be loaded."""


class PluginAPIVersionError(PluginError):
    """A plugin does not support this lmkit's ``PLUGIN_API_VERSION``."""


class DuplicateSpecError(PluginError):
    """Two plugins registered the same name for the same kind."""


class UnknownBackendError(ConfigError):
    """A backend was asked for by a name that no plugin registered."""


class NoBackendError(ConfigError):
    """No registered backend of a kind fits what the configuration needs."""


class StackConflictError(ConfigError):
    """The chosen backends of different kinds are incompatible with each other."""


class ModelNotFoundError(LMKitError, FileNotFoundError):
    """A model path, alias or hub id could not be resolved to local files."""


class ModelLoadError(LMKitError):
    """Model files exist but could not be read (corrupt, truncated, unsupported)."""

    exit_code = 1


class InvalidRequestError(LMKitError, ValueError):
    """A request or its sampling parameters are invalid.

    ``param`` names the offending field and ``code`` is a machine-readable reason
    (e.g. ``context_length_exceeded``); the server maps these onto OpenAI-shaped errors.
    """

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


class RequestFaultError(InvalidRequestError):
    """A request the engine accepted failed while running because of its own parameters,
    not because of an engine fault: e.g. its constraints together leave no token to
    sample (a regex against ``allowed_token_ids``, ``min_tokens`` longer than the
    structured-output constraint allows). ``code`` says what happened
    (:data:`NO_ALLOWED_TOKEN`) and ``param`` names the parameter to change.

    The server answers it with 400 ``invalid_request_error``; ``LLM.generate`` returns
    it as the completion's ``error`` (its ``finish_reason`` is ``"error"``).
    """


NO_ALLOWED_TOKEN = "no_allowed_token"  # RequestFaultError.code: nothing left to sample


class EngineDeadError(LMKitError, RuntimeError):
    """The engine core stopped; requests in flight cannot complete."""

    exit_code = 1
