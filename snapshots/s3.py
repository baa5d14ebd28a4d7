"""The object-storage seam: s3:// URIs, transfer settings, one client with our retries and errors.

Everything that talks to S3 goes through `S3.call` (one request) or `S3.run` (a unit of work that
may make several requests, such as a ranged GET and the writes of its body). Both run under one
retry policy, ours alone (botocore's own retries are turned off, so attempts do not multiply):

    retried        throttling (SlowDown, Throttling, 429, 503), other 5xx, connection errors,
                   timeouts, a body cut short
    not retried    every other 4xx, TLS errors, bad credentials: they will not get better

and every failure leaves as one of our errors with a one-line message (see `snapshots.errors`):

    NoSuchBucket                                     -> RemoteNotFound
    InvalidAccessKeyId, SignatureDoesNotMatch,
    AccessDenied, no credentials found               -> RemoteDenied
    unreachable / throttled / 5xx after retries      -> RemoteUnavailable
    anything else                                    -> RemoteError

Credentials come from the standard AWS chain (environment, shared files, SSO, instance role):
aiobotocore's session resolves them; nothing here reads keys.
"""

from __future__ import annotations

import asyncio
import functools
import os
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit

import aiohttp
from aiobotocore.config import AioConfig
from aiobotocore.session import get_session
from botocore import exceptions as boto
from botocore.loaders import Loader, create_loader
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_random_exponential

from snapshots.errors import RemoteDenied, RemoteError, RemoteNotFound, RemoteUnavailable

T = TypeVar("T")

MiB = 1024 * 1024
# 8 MiB, as s3transfer's default: a pull's `concurrency` GETs then cover a 64 MiB window of a file,
# so parts land nearly in order and the sha256 that follows them in order keeps pace on another
# core; with 64 MiB parts eight GETs span 512 MiB, all land together, and hashing waits for the end.
DEFAULT_PART_SIZE = 8 * MiB
# Ranged GETs work at any size; S3 itself refuses multipart uploads whose parts (all but the last)
# are under 5 MiB, which `push` reports clearly. 1 MiB lets tests and small stores use small parts.
MIN_PART_SIZE = 1 * MiB
MAX_PART_SIZE = 5 * 1024 * MiB  # S3's limit for one part
MAX_PARTS = 10_000  # S3's limit per multipart upload

_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_THROTTLE_CODES = frozenset(
    {"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequests"}
)
_TRANSIENT_CODES = frozenset({"RequestTimeout", "InternalError", "ServiceUnavailable"})
_CREDENTIAL_CODES = frozenset({"InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken"})


@dataclass(frozen=True)
class S3Uri:
    """`s3://bucket/prefix`: where one snapshot lives. The prefix has no leading or trailing '/'."""

    bucket: str
    prefix: str

    @classmethod
    def parse(cls, uri: str) -> S3Uri:
        if not isinstance(uri, str) or not uri.startswith("s3://"):
            raise RemoteError(f"not an S3 URI: {uri!r} (expected s3://bucket/prefix)")
        bucket, _, prefix = uri[len("s3://") :].partition("/")
        if not _BUCKET.fullmatch(bucket) or ".." in bucket:
            raise RemoteError(
                f"invalid bucket name {bucket!r} in {uri}: 3-63 lowercase letters, digits, '.' or '-'"
            )
        prefix = prefix.strip("/")
        if prefix and any(part in ("", ".", "..") for part in prefix.split("/")):
            raise RemoteError(f"invalid prefix in {uri}: empty, '.' or '..' path segments")
        return cls(bucket, prefix)

    def key(self, rel: str) -> str:
        """The object key of a snapshot file (a manifest path, already checked to be safe)."""
        return f"{self.prefix}/{rel}" if self.prefix else rel

    def url(self, rel: str | None = None) -> str:
        return f"s3://{self.bucket}/{self.key(rel) if rel else self.prefix}".rstrip("/")

    def __str__(self) -> str:
        return self.url()


@dataclass(frozen=True)
class RemoteConfig:
    """How to reach the store and how hard to push it. Validated on construction.

    Memory while pushing is at most `concurrency * part_size` (each part is read whole, since the
    request is signed over its bytes): 8 * 8 MiB = 64 MiB with the defaults. Pulls stream
    ranged GETs straight to disk in 1 MiB writes.
    """

    endpoint_url: str | None = None  # None: AWS itself (or whatever the AWS config says)
    region: str | None = None  # None: from the AWS config or environment
    part_size: int = DEFAULT_PART_SIZE
    concurrency: int = 8
    retry_attempts: int = 5  # attempts in all, the first included
    retry_backoff_s: float = 0.5  # first wait is random in [0, this]; doubles up to the max
    retry_max_backoff_s: float = 20.0
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.endpoint_url is not None:
            parts = urlsplit(self.endpoint_url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise RemoteError(
                    f"invalid endpoint URL {self.endpoint_url!r}: expected http(s)://host[:port]"
                )
        _check_int("part size", self.part_size, MIN_PART_SIZE, MAX_PART_SIZE, "bytes")
        _check_int("concurrency", self.concurrency, 1, 256, "")
        _check_int("retry attempts", self.retry_attempts, 1, 50, "")
        for what, value in (
            ("retry backoff", self.retry_backoff_s),
            ("retry max backoff", self.retry_max_backoff_s),
            ("connect timeout", self.connect_timeout_s),
            ("read timeout", self.read_timeout_s),
        ):
            if not isinstance(value, int | float) or not 0 < value <= 3600:
                raise RemoteError(f"invalid {what} {value!r}: expected seconds in (0, 3600]")

    @classmethod
    def from_env(cls, endpoint_url: str | None = None, **settings: Any) -> RemoteConfig:
        """A config whose endpoint is `endpoint_url`, else `AWS_ENDPOINT_URL_S3` or `AWS_ENDPOINT_URL`."""
        endpoint = (
            endpoint_url
            or os.environ.get("AWS_ENDPOINT_URL_S3")
            or os.environ.get("AWS_ENDPOINT_URL")
            or None
        )
        return cls(endpoint_url=endpoint, **settings)

    @property
    def where(self) -> str:
        """The store, as error messages name it."""
        return self.endpoint_url or "AWS S3"

    def upload_part_size(self, size: int) -> int:
        """The part size for uploading a `size`-byte file: ours, grown if S3's 10,000-part cap needs it."""
        return max(self.part_size, -(-size // MAX_PARTS))


def _check_int(what: str, value: object, low: int, high: int, unit: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        unit = f" {unit}" if unit else ""
        raise RemoteError(f"invalid {what} {value!r}: expected {low}..{high}{unit}")


def error_code(exc: BaseException) -> tuple[str, int]:
    """(S3 error code, HTTP status) of a ClientError; HEAD errors have no body, so the code is the status."""
    if not isinstance(exc, boto.ClientError):
        return "", 0
    status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
    code = str(exc.response.get("Error", {}).get("Code") or status)
    return code, status


class ShortBody(Exception):
    """A response body that ended before its promised length without an error from the transport."""


def is_retryable(exc: BaseException) -> bool:
    """Throttling, 5xx, connection trouble and timeouts: worth another try. Nothing else is."""
    if isinstance(exc, boto.ClientError):
        code, status = error_code(exc)
        return code in _THROTTLE_CODES or code in _TRANSIENT_CODES or status == 429 or status >= 500
    if isinstance(exc, boto.SSLError):
        return False  # a certificate problem stays one
    return isinstance(
        exc,
        boto.ConnectionError  # refused, DNS, connect timeout
        | boto.HTTPClientError  # closed mid-response, read timeout, body cut short
        | boto.IncompleteReadError
        | aiohttp.ClientError
        | asyncio.TimeoutError
        | ConnectionError
        | ShortBody,
    )


def translate(exc: BaseException, what: str, config: RemoteConfig, attempts: int) -> RemoteError:
    """Our one-line error for a failure of `what` (e.g. "GET s3://b/p/manifest.json")."""
    error = _translate(exc, what, config, attempts)
    text = " ".join(str(error).split())  # a store's message may span lines; ours never does
    return error if text == str(error) else type(error)(text)


def _translate(exc: BaseException, what: str, config: RemoteConfig, attempts: int) -> RemoteError:
    if isinstance(exc, RemoteError):
        return exc
    if isinstance(exc, boto.NoCredentialsError | boto.PartialCredentialsError):
        return RemoteDenied(
            f"no AWS credentials found for {what}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
            "AWS_PROFILE, or run where an instance role applies"
        )
    if isinstance(exc, boto.ClientError):
        code, _ = error_code(exc)
        message = exc.response.get("Error", {}).get("Message") or ""
        if code == "EntityTooSmall":
            return RemoteError(
                f"{config.where} refused parts of {config.part_size} bytes as too small (EntityTooSmall) in "
                f"{what}: S3 needs at least 5 MiB per part"
            )
        if code in _CREDENTIAL_CODES:
            hint = {
                "InvalidAccessKeyId": "the access key id is not known to the store",
                "SignatureDoesNotMatch": "the secret access key does not match the access key id",
            }.get(code, "the session credentials are not valid")
            return RemoteDenied(f"wrong AWS credentials for {config.where}: {hint} ({code}) in {what}")
        if code in ("AccessDenied", "403", "AllAccessDisabled"):
            return RemoteDenied(f"access denied: {what} ({code}); check the credentials' permissions")
        if code == "NoSuchBucket":
            return RemoteNotFound(f"no such bucket: {what} ({config.where})")
        if code in ("NoSuchKey", "404"):
            return RemoteNotFound(f"not found: {what}")
        if is_retryable(exc):
            return RemoteUnavailable(
                f"{config.where} kept failing {what}: {code} {message}".rstrip()
                + f" (after {attempts} attempt{'s' if attempts != 1 else ''})"
            )
        return RemoteError(f"{what} failed: {code} {message}".rstrip())
    if isinstance(exc, boto.SSLError):
        return RemoteError(f"TLS error talking to {config.where}: {exc}")
    if is_retryable(exc):
        reason = str(exc) or type(exc).__name__
        return RemoteUnavailable(
            f"cannot reach {config.where} for {what}: {reason} (after {attempts} attempt{'s' if attempts != 1 else ''})"
        )
    return RemoteError(f"{what} failed: {exc}")


class S3:
    """An aiobotocore S3 client plus our retry policy and error translation."""

    def __init__(self, client: Any, config: RemoteConfig) -> None:
        self.client = client
        self.config = config

    def _retrying(self) -> AsyncRetrying:
        c = self.config
        return AsyncRetrying(
            retry=retry_if_exception(is_retryable),
            stop=stop_after_attempt(c.retry_attempts),
            # Full jitter: spreads the retries of many parts (and many nodes) hitting one throttled
            # bucket, instead of sending them back in lockstep.
            wait=wait_random_exponential(multiplier=c.retry_backoff_s, max=c.retry_max_backoff_s),
            reraise=True,
        )

    async def run(self, fn: Callable[[], Awaitable[T]], what: str) -> T:
        """Await `fn()` under the retry policy; a failure that outlasts it becomes a RemoteError.

        `fn` must be safe to start over: it is called afresh on every attempt.
        """
        retrying = self._retrying()
        try:
            async for attempt in retrying:
                with attempt:
                    return await fn()
        except (
            boto.BotoCoreError,
            boto.ClientError,
            aiohttp.ClientError,
            TimeoutError,
            ConnectionError,  # an OSError, but the network's, not the disk's
            ShortBody,
        ) as exc:
            attempts = retrying.statistics.get("attempt_number", 1)
            raise translate(exc, what, self.config, attempts) from exc
        raise AssertionError("unreachable: tenacity either returns or raises")

    async def call(self, operation: str, what: str, **params: Any) -> dict[str, Any]:
        """One S3 API call (e.g. "head_object"), retried; its response dict."""
        method = getattr(self.client, operation)
        return await self.run(lambda: method(**params), what)

    async def head(self, bucket: str, key: str, what: str) -> dict[str, Any]:
        """HEAD an object. A HEAD's error has no body, so a 403 cannot tell wrong credentials from
        missing permissions; a one-byte GET of the same key is asked for the reason then.
        """
        try:
            return await self.call("head_object", what, Bucket=bucket, Key=key)
        except RemoteDenied as denied:
            if error_code(denied.__cause__)[0] != "403":
                raise
            await self.call("get_object", what, Bucket=bucket, Key=key, Range="bytes=0-0")
            raise  # the GET was allowed after all: the HEAD's own answer stands


@functools.cache
def _botocore_data(data_path: str | None) -> Loader:
    """botocore's loader of its own JSON (service models, endpoints), one per process and data path
    (`AWS_DATA_PATH`, as a session's own loader would take it).

    A fresh session parses ~1.5 MB of it for its first client: 0.15 CPU-s here, 0.4-1 s on a
    loaded machine, paid by every pull and push (a node pulls many), where the transfer of a
    500 MB snapshot takes about 1.5 s. Its caches hold only those read-only files, never
    credentials or settings (each session still resolves its own), so sharing it is safe.
    """
    return create_loader(data_path)


@asynccontextmanager
async def connect(config: RemoteConfig) -> AsyncIterator[S3]:
    """An S3 client for `config`, closed on exit (its connection pool sized for `concurrency`)."""
    aio_config = AioConfig(
        retries={"total_max_attempts": 1},  # the retry policy is ours alone (see S3.run)
        max_pool_connections=config.concurrency + 2,
        connect_timeout=config.connect_timeout_s,
        read_timeout=config.read_timeout_s,
        # S3-compatible stores (MinIO, SeaweedFS, Ceph, R2) want bucket-in-path addressing, and
        # several reject the CRC headers botocore adds by default since 1.36; the manifest's sha256
        # is what guards the bytes end to end.
        s3={"addressing_style": "path"} if config.endpoint_url else {},
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    session = get_session()
    session.register_component("data_loader", _botocore_data(session.get_config_variable("data_path")))
    async with session.create_client(
        "s3", endpoint_url=config.endpoint_url, region_name=config.region, config=aio_config
    ) as client:
        yield S3(client, config)
