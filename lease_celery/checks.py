"""Validators and codecs every layer shares: keys, durations, owners, and the JSON forms of
results, checkpoints and task info.

A value is checked once, where it enters (the store's public methods, the settings, the
task's options); each refusal names the value and what was expected. Results and checkpoints
are strict JSON, never pickle: the store must not become a way to run code.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from kombu.utils import json as kombu_json

from .errors import CheckpointNotSerializable, ConfigError, InvalidKey, ResultNotSerializable

__all__ = [
    "MAX_KEY_LENGTH",
    "MIN_SECONDS",
    "EncodedResult",
    "cancel_reason",
    "check_delay",
    "check_key",
    "check_owner",
    "check_page_size",
    "check_ttl",
    "decode_result",
    "decode_task",
    "encode_checkpoint",
    "encode_result",
    "encode_task",
]


#: Shortest accepted duration (ttl, timeouts), in seconds.
MIN_SECONDS = 0.001


#: Longest accepted lease key, in characters. Keys are identifiers, not payloads.
MAX_KEY_LENGTH = 512


def check_key(key: object) -> str:
    """Return ``key`` if it is a usable lease key, else raise ``InvalidKey`` naming the problem."""
    if not isinstance(key, str):
        raise InvalidKey(f"lease key must be a str, got {type(key).__name__}: {key!r}")
    if not key or not key.strip():
        raise InvalidKey("lease key must not be empty")
    _check_text(key, "lease key", InvalidKey)
    if len(key) > MAX_KEY_LENGTH:
        raise InvalidKey(
            f"lease key is {len(key)} characters long; the limit is {MAX_KEY_LENGTH}: {key[:40]!r}…"
        )
    return key


def check_ttl(ttl: object, *, name: str = "ttl") -> float:
    """Return ``ttl`` as float seconds if finite and positive, else raise ``ConfigError``."""
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)):
        raise ConfigError(f"{name} must be a number of seconds, got {type(ttl).__name__}: {ttl!r}")
    value = float(ttl)
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{name} must be a finite number of seconds > 0, got {ttl!r}")
    if value < MIN_SECONDS:
        # At epoch scale, now + 1e-9 == now: such a lease would be born expired.
        raise ConfigError(f"{name} must be at least {MIN_SECONDS}s, got {ttl!r}")
    return value


def check_delay(seconds: object, *, name: str = "delay") -> float:
    """Return ``seconds`` as a finite float >= 0, else raise ``ConfigError``."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not (
            math.isfinite(seconds) and seconds >= 0):
        raise ConfigError(f"{name} must be a finite number of seconds >= 0, got {seconds!r}")
    return float(seconds)


def check_page_size(limit: object) -> int:
    """A page size (``limit=`` of the reads and batches: at most that many rows), a whole
    number >= 1. Not a concurrency limit: that is ``limits.check_concurrency``."""
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ConfigError(f"limit must be a whole number >= 1, got {limit!r}")
    return limit


def check_owner(owner: object) -> str:
    if not isinstance(owner, str) or not owner.strip():
        raise ConfigError(f"lease owner must be a non-empty str, got {owner!r}")
    _check_text(owner, "lease owner", ConfigError)
    return owner


def _check_text(text: str, what: str, error: type[Exception]) -> None:
    """Refuse what some store cannot hold: NUL (PostgreSQL text) and unpaired surrogates."""
    if "\x00" in text:
        raise error(f"{what} must not contain NUL characters: {text[:40]!r}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise error(f"{what} is not valid Unicode text ({exc.reason}): {text[:40]!r}") from None


class EncodedResult(str):
    """A result ``encode_result`` already turned into JSON: encoding it again is a no-op (the
    gate encodes a background finish's result early, to refuse a non-JSON one in the task)."""

    __slots__ = ()


def encode_result(result: Any) -> str:
    """Serialize a task result to JSON as kombu's JSON does, which is what Celery's default
    result serializer carries: datetimes, UUIDs, Decimals and bytes as tagged values (never
    pickle: the store must not run code). Strict JSON text all the same (no NaN)."""
    if type(result) is EncodedResult:
        return result
    try:
        text: str = kombu_json.dumps(  # type: ignore[no-untyped-call]
            result, allow_nan=False, separators=(",", ":"), sort_keys=True)
    except (TypeError, ValueError) as exc:
        raise ResultNotSerializable(
            f"lease results must be JSON-serializable (Celery's JSON: datetimes, UUIDs, "
            f"Decimals and bytes too); {type(result).__name__} is not ({exc})") from exc
    return text


def encode_checkpoint(data: Any) -> str:
    """A checkpoint as strict JSON, or ``CheckpointNotSerializable`` naming the problem."""
    try:
        return json.dumps(data, allow_nan=False, separators=(",", ":"), sort_keys=True)
    except (TypeError, ValueError) as exc:
        raise CheckpointNotSerializable(
            f"lease checkpoints must be JSON-serializable; {type(data).__name__} is not "
            f"({exc})") from exc


def cancel_reason(reason: object) -> str:
    """The stored form of an operator's cancel reason: ``cancelled: <reason>``."""
    if not isinstance(reason, str):
        raise TypeError(f"cancel reason must be a str, got {type(reason).__name__}")
    _check_text(reason, "cancel reason", ValueError)
    return f"cancelled: {reason.strip() or 'by an operator'}"[:2000]


def encode_task(task: Mapping[str, Any] | None) -> str | None:
    """Task info as kombu's JSON (which, like Celery's default serializer, carries datetime,
    Decimal and UUID), or None when there is none or it cannot be encoded (then only the
    broker can redeliver the task)."""
    if task is None:
        return None
    try:
        text: str = kombu_json.dumps(dict(task))  # type: ignore[no-untyped-call]
    except (TypeError, ValueError):
        return None
    return text


def decode_task(text: str | None) -> dict[str, Any] | None:
    if text is None:
        return None
    decoded: dict[str, Any] = kombu_json.loads(text)  # type: ignore[no-untyped-call]
    return decoded


def decode_result(text: str | None) -> Any:
    return None if text is None else kombu_json.loads(text)  # type: ignore[no-untyped-call]

