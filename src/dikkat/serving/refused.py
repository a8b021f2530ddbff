"""The error a request the server refuses raises (:mod:`dikkat.serving.protocol` and the
routes): it becomes OpenAI's error object with the status and the field it names."""

from __future__ import annotations


class RequestError(ValueError):
    """A request the server refuses: the HTTP status, and the OpenAI ``param`` and ``code``."""

    def __init__(
        self, message: str, *, param: str | None = None, status: int = 400, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.param, self.status, self.code = param, status, code
