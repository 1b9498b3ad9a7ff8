"""OpenAI's error object and the exception that carries it (its own module: every request module raises it)."""
from __future__ import annotations

from typing import Any


class APIError(Exception):
    """An HTTP error answered with OpenAI's error object (status, message, type, param, code)."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object: what its clients parse into `APIError.message`, `.type`, `.param`, `.code`."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}
