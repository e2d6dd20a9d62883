"""A batch record as the OpenAI batch object."""

from __future__ import annotations

from typing import Any

WINDOW_S = 24 * 3600


def batch_object(meta: dict[str, Any], model: str) -> dict[str, Any]:
    return {
        "id": meta["id"],
        "object": "batch",
        "endpoint": meta["endpoint"],
        "model": model,
        "errors": meta.get("errors"),
        "input_file_id": meta["input_file_id"],
        "completion_window": meta["completion_window"],
        "status": meta["status"],
        "output_file_id": meta.get("output_file_id"),
        "error_file_id": meta.get("error_file_id"),
        "created_at": meta["created_at"],
        "in_progress_at": meta.get("in_progress_at"),
        "expires_at": meta["created_at"] + WINDOW_S,
        "finalizing_at": meta.get("finalizing_at"),
        "completed_at": meta.get("completed_at"),
        "failed_at": meta.get("failed_at"),
        "expired_at": None,
        "cancelling_at": meta.get("cancelling_at"),
        "cancelled_at": meta.get("cancelled_at"),
        "request_counts": {
            "total": meta["total"],
            "completed": meta.get("completed", 0),
            "failed": meta.get("failed", 0),
        },
        "metadata": meta.get("metadata"),
    }
