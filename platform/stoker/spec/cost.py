"""What the cost API and `stoker cost` take: the window they answer for (`since`, 1 s to
`HISTORY_S`), as long as the cost meter keeps its per-minute history (`stoker.control.cost`)."""

from __future__ import annotations

HISTORY_S = 24 * 3600  # a day, kept per minute
