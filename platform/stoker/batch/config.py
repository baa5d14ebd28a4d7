"""The batch API's settings, their defaults and their bounds, written once (`stoker up`'s
`--upload-limit`, `--batch-share`, `--batch-concurrency` set three of them).

Pacing (`stoker.batch.pacing`) is what keeps a batch from holding interactive requests back:

- `share`: the fraction of a deployment's awake slots (READY instances × their concurrency) that
  batch requests may fill, interactive ones included in the count. With 8 slots and 0.25, a batch
  dispatches only while fewer than 2 requests of any kind are in flight, so an interactive arrival
  finds a free slot at once unless interactive traffic alone fills the other six. 0.25, not 0.5:
  what a batch costs interactive traffic is the engine's own step shared with its sequences, and
  at 0.5 (4 batch sequences beside the interactive one) `bench/batch_bench.py` measured interactive
  p99 TTFT at 1.55× its baseline, over the 1.5× bound (docs/guide/batches.md).
- `concurrency`: requests in flight per batch at most, whatever the room.
- `tick_s`: how often a batch that was refused room looks again (a finishing line of its own
  looks at once).
"""

from __future__ import annotations

from dataclasses import dataclass

MiB = 1 << 20


@dataclass(frozen=True)
class BatchConfig:
    upload_limit_bytes: int = 200 * MiB  # one uploaded file at most (OpenAI's batch input limit)
    max_files: int = 10_000  # files one tenant keeps at once
    max_lines: int = 50_000  # requests in one batch (OpenAI's bound)
    max_active: int = 100  # batches of one tenant not yet finished
    share: float = 0.25
    concurrency: int = 8
    tick_s: float = 0.1
    retry_s: float = 1.0  # the first wait before a 429/503 line is tried again; doubled each time
    max_attempts: int = 6  # tries of one line before its last answer goes to the error file
    min_window_s: float = 60.0  # the completion windows a batch may ask for
    max_window_s: float = 7 * 86400.0
    files_store: str | None = None  # s3://bucket/prefix for the files' bytes (`stoker.batch.objects`)

    def __post_init__(self) -> None:
        checks = (
            ("upload_limit_bytes", self.upload_limit_bytes, 1, 1 << 40),
            ("max_files", self.max_files, 1, 10_000_000),
            ("max_lines", self.max_lines, 1, 10_000_000),
            ("max_active", self.max_active, 1, 100_000),
            ("share", self.share, 0.0, 1.0),
            ("concurrency", self.concurrency, 1, 4096),
            ("tick_s", self.tick_s, 0.001, 60.0),
            ("retry_s", self.retry_s, 0.001, 3600.0),
            ("max_attempts", self.max_attempts, 1, 100),
            ("min_window_s", self.min_window_s, 1.0, self.max_window_s),
        )
        for name, value, low, high in checks:
            if isinstance(value, bool) or not low <= value <= high:
                raise ValueError(f"batch setting {name} must be in [{low:g}, {high:g}], got {value!r}")
        if self.files_store is not None:
            from snapshots.s3 import S3Uri

            S3Uri.parse(self.files_store)  # a RemoteError (one line) if it is not an s3:// URI
        if self.share == 0.0:
            raise ValueError("batch setting share must be above 0 (a batch would never run), got 0")
