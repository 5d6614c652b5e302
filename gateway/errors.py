"""The gateway's one exception type, rendered in OpenAI's error shape.

Every failure an agent or admin can see is a `GatewayError` carrying the HTTP status and the
OpenAI `type`; the app turns it into `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

from typing import Any


class GatewayError(Exception):
    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(message: str, *, param: str | None = None, code: str | None = None) -> GatewayError:
    return GatewayError(400, message, param=param, code=code)


def unauthorized(message: str) -> GatewayError:
    return GatewayError(401, message, type="authentication_error", code="invalid_api_key")


def not_found(message: str) -> GatewayError:
    return GatewayError(404, message, type="not_found_error", code="not_found")


def too_large(message: str) -> GatewayError:
    return GatewayError(413, message, code="request_too_large")


def conflict(message: str) -> GatewayError:
    return GatewayError(409, message, type="invalid_request_error", code="conflict")


def unavailable(message: str) -> GatewayError:
    return GatewayError(503, message, type="service_unavailable", code="no_replica")


def upstream_failed(message: str) -> GatewayError:
    return GatewayError(502, message, type="upstream_error", code="replica_error")
