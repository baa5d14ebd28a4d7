"""A batch as it is kept (`BatchRecord`) and shown (OpenAI's Batch object), and where it is kept
(`BatchStore`): one JSON file a batch, replaced atomically at each change of state.

    <data dir>/batches/<tenant>/batch_<24 hex>.json     the record
    <data dir>/batches/<tenant>/batch_<24 hex>/         its output.jsonl and errors.jsonl while it runs

OpenAI's states, and what moves a batch between them (`stoker.batch.runner`):

    validating ──▶ in_progress ──▶ finalizing ──▶ completed
        │               │ cancel                  (output_file_id, error_file_id set here)
        ▼               ▼
      failed        cancelling ──▶ cancelled      expires_at passed in_progress: ──▶ expired

`request_counts` and `usage` are counted from the result files while a batch runs (they are the
journal, `stoker.batch.results`), and written into the record at each change of state, so a
finished batch reads them from its record alone. The two file ids are drawn when the batch is
made and shown once the files exist.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from stoker.batch.disk import ensure_dir, read_small, sweep_temps, write_atomic
from stoker.batch.files import ADMIN_OWNER, new_file_id
from stoker.spec.keys import TENANT

BATCH_ID = re.compile(r"batch_[0-9a-f]{24}")
RUNNING = ("validating", "in_progress", "finalizing", "cancelling")
DONE = ("completed", "failed", "expired", "cancelled")
RECORD_BYTES = 1 << 20


@dataclass
class BatchRecord:
    id: str
    owner: str
    key_id: str  # whose key runs it: its deployments and limits, read again at each line
    endpoint: str
    input_file_id: str
    completion_window: str
    window_s: float
    created_at: int
    expires_at: int
    metadata: dict[str, str] | None = None
    status: str = "validating"
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    errors: list[dict[str, Any]] | None = None
    model: str | None = None
    total: int = 0
    completed: int = 0
    failed: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    output_id: str = field(default_factory=new_file_id)  # drawn now, shown once the file exists
    error_id: str = field(default_factory=new_file_id)
    output_file_id: str | None = None
    error_file_id: str | None = None
    ending: str | None = None  # how it ends once finalized: None (completed), "expired", "cancelled"
    counted: bool = False  # its last counts are in the record: its result files may be moved out
    cost_base: dict[str, list[float]] | None = None  # its deployments' figures as it began (`cost`)
    cost_usd: float = 0.0  # its share of what they spent since (`stoker.batch.cost`)

    @property
    def running(self) -> bool:
        return self.status in RUNNING

    def to_dict(self) -> dict[str, Any]:
        """OpenAI's Batch object."""
        return {
            "id": self.id,
            "object": "batch",
            "endpoint": self.endpoint,
            "model": self.model,
            "errors": None if not self.errors else {"object": "list", "data": self.errors},
            "input_file_id": self.input_file_id,
            "completion_window": self.completion_window,
            "status": self.status,
            "output_file_id": self.output_file_id,
            "error_file_id": self.error_file_id,
            "created_at": self.created_at,
            "in_progress_at": self.in_progress_at,
            "expires_at": self.expires_at,
            "finalizing_at": self.finalizing_at,
            "completed_at": self.completed_at,
            "failed_at": self.failed_at,
            "expired_at": self.expired_at,
            "cancelling_at": self.cancelling_at,
            "cancelled_at": self.cancelled_at,
            "request_counts": {"total": self.total, "completed": self.completed, "failed": self.failed},
            "usage": {
                "input_tokens": self.input_tokens,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": self.output_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": self.input_tokens + self.output_tokens,
            },
            "metadata": self.metadata,
            "cost_usd": self.cost_usd,  # Stoker's own: not in OpenAI's Batch object
        }


def new_batch_id() -> str:
    return "batch_" + secrets.token_hex(12)


class BatchStore:
    """Every batch's record, in memory and on disk (written through at each `save`)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._records: dict[str, BatchRecord] = {}

    def load(self) -> list[BatchRecord]:
        """Every record on disk (at start); a damaged one is skipped, and said to be."""
        damaged = []
        if self.root.is_dir():
            for owner in self.root.iterdir():
                if owner.is_symlink() or not owner.is_dir():
                    continue
                sweep_temps(owner)
                for path in owner.glob("batch_*.json"):
                    try:
                        record = BatchRecord(**json.loads(read_small(path, RECORD_BYTES) or b"{}"))
                    except (ValueError, TypeError):
                        damaged.append(path.name)
                        continue
                    self._records[record.id] = record
        return damaged

    def dir_of(self, owner: str) -> Path:
        if owner != ADMIN_OWNER and not TENANT.fullmatch(owner):
            raise ValueError(f"not an owner: {owner!r}")
        return ensure_dir(self.root / owner)

    def work_dir(self, record: BatchRecord) -> Path:
        return ensure_dir(self.dir_of(record.owner) / record.id)

    def save(self, record: BatchRecord) -> None:
        write_atomic(self.dir_of(record.owner) / f"{record.id}.json", json.dumps(asdict(record)).encode())
        self._records[record.id] = record

    def get(self, owner: str, batch_id: str) -> BatchRecord | None:
        record = self._records.get(batch_id)
        return record if record is not None and record.owner == owner else None

    def of(self, owner: str) -> list[BatchRecord]:
        """The owner's batches, newest first."""
        mine = [r for r in self._records.values() if r.owner == owner]
        return sorted(mine, key=lambda r: (r.created_at, r.id), reverse=True)

    def all(self) -> list[BatchRecord]:
        return list(self._records.values())
