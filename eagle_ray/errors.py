"""Typed errors: every message says what was wrong and what to do about it."""


class EagleError(Exception):
    """Base class for errors raised by eagle-ray."""


class ConfigError(EagleError, ValueError):
    """A configuration or sampling value is out of range."""


class CheckpointError(EagleError):
    """A model or draft-head checkpoint is missing, malformed or does not match its partner."""


class PromptTooLongError(EagleError, ValueError):
    """A prompt (plus at least one new token) does not fit the engine's context."""


class InvalidRequestError(EagleError, ValueError):
    """A request is malformed (empty prompt, bad roles, wrong types)."""


class EngineDeadError(EagleError, RuntimeError):
    """The engine failed in a step (a device error, a bug): it serves nothing more and must be replaced."""


class EngineStalledError(EngineDeadError):
    """An engine step ran past its bound (a hung kernel, a deadlock): the engine is failed rather than waited on."""


class InsufficientMemoryError(ConfigError):
    """The engine's memory plan (weights, KV slots, workspace) does not fit the device's free memory."""


def first_line(e: BaseException, limit: int = 300) -> str:
    """The first line of an exception's message, capped: a library's error about a bad file can run to pages
    (every key of a model), and the one-line error that quotes it must stay one line."""
    text = (str(e).strip().splitlines() or [""])[0]
    return text if len(text) <= limit else text[:limit] + " ..."
