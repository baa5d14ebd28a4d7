"""A histogram of a deployment's idle gaps: from running out of work to the next arrival.

After Shahrad et al., "Serverless in the Wild" (USENIX ATC 2020), §4.2: the head of the
distribution (5th percentile) says when the next request may come at the earliest, the tail (99th)
how long it is worth waiting for it. With a 10 % margin each way (head × 0.9, tail × 1.1) these
become the pre-warm point and the end of the keep-alive window, measured from the start of the gap.
The paper counts 1-minute bins up to 4 hours, for functions idle for minutes to hours. LLM
deployments here idle for seconds to minutes (the shared traces: gaps of 5 s to 5 min), and the
control loop acts every second, so the defaults are 1-second bins up to 10 minutes (600 bins, about
the paper's 240 in count): finer bins than the loop's tick would buy nothing, and a gap beyond 10
minutes is left to the fallback, as the paper leaves its beyond-4-hours gaps to another predictor.

The histogram is representative when it holds at least `min_samples` gaps, at most half of them
out of range, and its bin counts have a coefficient of variation of at least `cv_threshold` (2, as
in the paper): a flat histogram (gaps spread evenly) predicts nothing. Otherwise `windows` returns
None and the policy falls back to a fixed keep-alive.

Bounded: a fixed number of bins; when the count reaches `max_samples` every bin is halved (counts
are floats, so a lone old gap fades instead of vanishing), so old gaps weigh less and less (a
half-life of `max_samples / 2` gaps).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from warm_pool.errors import InvalidConfig


@dataclass(frozen=True)
class HistogramConfig:
    bin_s: float = 1.0
    range_s: float = 600.0
    head_pct: float = 5.0
    tail_pct: float = 99.0
    margin: float = 0.10
    min_samples: int = 5
    cv_threshold: float = 2.0
    max_samples: int = 500

    def __post_init__(self) -> None:
        if not (self.bin_s > 0 and self.range_s >= self.bin_s and self.range_s / self.bin_s <= 10_000):
            raise InvalidConfig(
                "bin_s", f"need 0 < bin_s ≤ range_s and at most 10000 bins, got {self.bin_s}, {self.range_s}"
            )
        if not 0 <= self.head_pct < self.tail_pct <= 100:
            raise InvalidConfig(
                "head_pct", f"need 0 ≤ head_pct < tail_pct ≤ 100, got {self.head_pct}, {self.tail_pct}"
            )
        if not 0 <= self.margin < 1:
            raise InvalidConfig("margin", f"margin must be in [0, 1), got {self.margin}")
        if self.min_samples < 1 or self.max_samples < 2 * self.min_samples:
            raise InvalidConfig(
                "min_samples",
                f"need 1 ≤ min_samples ≤ max_samples / 2, got {self.min_samples}, {self.max_samples}",
            )

    @property
    def bins(self) -> int:
        return math.ceil(self.range_s / self.bin_s)


@dataclass(frozen=True)
class IdleHistogram:
    counts: tuple[float, ...] = ()  # empty until the first gap; then `config.bins` entries
    out_of_range: float = 0.0

    @property
    def total(self) -> float:
        return sum(self.counts) + self.out_of_range

    def add(self, gaps: tuple[float, ...], config: HistogramConfig) -> IdleHistogram:
        if not gaps:
            return self
        counts = list(self.counts) or [0.0] * config.bins
        oob = self.out_of_range
        for gap in gaps:
            index = int(max(gap, 0.0) // config.bin_s)
            if index < len(counts):
                counts[index] += 1.0
            else:
                oob += 1.0
            if sum(counts) + oob >= config.max_samples:
                counts, oob = [n / 2 for n in counts], oob / 2
        return IdleHistogram(tuple(counts), oob)

    def percentile(self, pct: float, config: HistogramConfig, *, upper: bool) -> float:
        """The gap length below which `pct` % of in-range gaps fall: the bin's lower edge for a
        head (pre-warm a little early), its upper edge for a tail (keep a little longer)."""
        in_range = sum(self.counts)
        if in_range == 0:
            return 0.0
        needed, seen = pct / 100.0 * in_range, 0.0
        for index, n in enumerate(self.counts):
            seen += n
            if n and seen >= needed - 1e-9:
                return (index + (1 if upper else 0)) * config.bin_s
        return config.range_s

    def cv(self) -> float:
        """Coefficient of variation of the bin counts (0 for an empty or flat histogram)."""
        if not self.counts:
            return 0.0
        mean = sum(self.counts) / len(self.counts)
        if mean == 0:
            return 0.0
        var = sum((n - mean) ** 2 for n in self.counts) / len(self.counts)
        return math.sqrt(var) / mean

    def representative(self, config: HistogramConfig) -> bool:
        total = self.total
        return (
            total >= config.min_samples
            and self.out_of_range * 2 <= total
            and self.cv() >= config.cv_threshold
        )

    def windows(self, config: HistogramConfig) -> tuple[float, float] | None:
        """(pre-warm point, end of keep-alive), seconds into an idle gap; None if not representative."""
        if not self.representative(config):
            return None
        head = self.percentile(config.head_pct, config, upper=False) * (1 - config.margin)
        tail = self.percentile(config.tail_pct, config, upper=True) * (1 + config.margin)
        return head, tail
