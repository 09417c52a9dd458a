"""The error every model-directory reader raises: it names the file and says what was expected."""


class ModelDirError(Exception):
    """A model directory file is missing, unreadable or not what CosyVoice2 expects."""

    def __init__(self, file: str, message: str):
        self.file = file
        self.message = message
        super().__init__(f"{file}: {message}")
