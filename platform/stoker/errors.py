"""Errors of Stoker that reach a user, and the one place each becomes what the user sees.

- `CLIError`: a command-line error, printed as one line (`stoker: error: …`), exit status 1.
- `APIError`: an HTTP error in OpenAI's JSON shape, shared by the gateway, the admin API and the
  CPU engine. The one place that turns it into HTTP is `error_response`. The body is OpenAI's:

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens", "code": null}}

  so the official clients raise their usual exception classes (`BadRequestError`, `NotFoundError`,
  `InternalServerError`, ...).
"""

from __future__ import annotations

from starlette.responses import JSONResponse

INVALID_REQUEST = "invalid_request_error"
NOT_FOUND = "not_found_error"
UNAVAILABLE = "service_unavailable_error"
AUTHENTICATION = "authentication_error"
SERVER_ERROR = "server_error"


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unavailable(message: str, code: str, retry_after_s: int = 1) -> APIError:
    return APIError(503, message, type=UNAVAILABLE, code=code, headers={"retry-after": str(retry_after_s)})


def unauthorized(message: str = "A valid API key is required: send `Authorization: Bearer KEY`.") -> APIError:
    return APIError(
        401, message, type=AUTHENTICATION, code="invalid_api_key", headers={"www-authenticate": "Bearer"}
    )


def error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


class CLIError(Exception):
    """A user-facing command-line error: printed as one line, exit status 1."""
