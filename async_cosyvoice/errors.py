"""Errors callers can act on. The gRPC layer maps each to one status code."""


class CosyVoiceError(Exception):
    """Base class for errors raised to callers of the library."""


class InvalidRequest(CosyVoiceError, ValueError):
    """The request is malformed (empty text, bad audio, out-of-range option). -> INVALID_ARGUMENT"""


class SpeakerNotFound(CosyVoiceError, KeyError):
    """No speaker with that id. -> NOT_FOUND"""

    def __str__(self):  # KeyError quotes its message; we want it plain
        return str(self.args[0]) if self.args else "speaker not found"


class SpeakerExists(CosyVoiceError):
    """A speaker with that id exists and overwrite was not asked for. -> ALREADY_EXISTS"""


class NotReady(CosyVoiceError):
    """The model is still loading or the service is shutting down. -> UNAVAILABLE"""


class Overloaded(CosyVoiceError):
    """Too many concurrent requests. -> RESOURCE_EXHAUSTED"""


class Unsupported(CosyVoiceError):
    """A valid request this model or configuration cannot serve. -> FAILED_PRECONDITION"""


class TextTimeout(CosyVoiceError):
    """A text stream sent no piece (nor its end) for longer than limits.text_idle_seconds. -> DEADLINE_EXCEEDED"""


class ModelDirError(Exception):
    """A model directory file is missing, unreadable or not what CosyVoice2 expects.
    The message names the file (relative to the directory) and what was expected."""

    def __init__(self, file: str, message: str):
        self.file = file
        self.message = message
        super().__init__(f"{file}: {message}")


class SpeakerCorrupt(CosyVoiceError):
    """A stored speaker record exists but cannot be read (truncated, garbled). Its data is gone:
    the speaker must be registered again. -> DATA_LOSS"""


class EngineDead(NotReady):
    """The speech-token engine died (its process was killed, its step loop failed). The instance
    cannot serve any more and is exiting. -> UNAVAILABLE"""


class ConfigError(CosyVoiceError, ValueError):
    """The configuration asks for what this machine cannot give (a device this torch build lacks,
    a port another process holds). Raised before anything is loaded; the message says the fix."""
