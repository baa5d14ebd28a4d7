"""What the admin API answers when the API server refused a write of the controller's."""

from __future__ import annotations

from lightkube import ApiError

from stoker.errors import APIError, invalid


def conflict(kind: str, name: str, exc: ApiError) -> APIError:
    """409: someone else wrote the resource since it was read (its resourceVersion moved on)."""
    return APIError(
        409,
        f"The {kind} {name!r} was changed by someone else while this write was made "
        f"({exc.status.message}); read it again and retry.",
        type="invalid_request_error",
        param="name",
        code="conflict",
    )


def refused(what: str, exc: ApiError) -> APIError:
    """What the API server refused, as the admin API answers it: 400 for what it found invalid,
    else 502 naming its answer."""
    if exc.status.code == 422:
        return invalid(f"The API server refused {what}: {exc.status.message}")
    return APIError(
        502,
        f"The API server refused {what}: {exc.status.code} {exc.status.reason}: {exc.status.message}",
        type="api_error",
        code="kubernetes_refused",
    )
