"""Client input as echoed in error details, for every room of the gateway: bounded, because
error details travel in trailers and gRPC caps their size."""

from __future__ import annotations


def clip(text: str, limit: int = 64) -> str:
    """`text`, cut to `limit` characters (and marked as cut) when longer."""
    return text if len(text) <= limit else text[:limit] + "..."
