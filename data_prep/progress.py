"""Progress: a tqdm bar (documents, tokens/s, MB/s) on a terminal, plain periodic log lines otherwise."""

from __future__ import annotations

import os
import sys
import time

from data_prep.console import human_bytes, human_count, log, set_active_bar


class Progress:
    def __init__(
        self,
        total_bytes: int | None = None,
        *,
        enabled: bool = True,
        interval: float = 30.0,
        label: str = "tokenize",
        force_plain: bool = False,
    ):
        self.docs = 0
        self.tokens = 0
        self.bytes = 0
        self.t0 = time.monotonic()
        self._last = self.t0
        self.interval = interval
        self.label = label
        self.enabled = enabled
        self._bar = None
        if enabled and not force_plain and sys.stderr.isatty():
            # lazy: tqdm takes ~35 ms to import, and only a terminal shows a bar
            from tqdm import tqdm

            try:
                cols = os.get_terminal_size(sys.stderr.fileno()).columns
            except OSError:
                cols = 0
            width = {"dynamic_ncols": True} if cols > 0 else {"ncols": 110, "nrows": 20}  # 0x0 pty
            self._bar = tqdm(
                total=total_bytes,
                unit="B",
                unit_scale=True,
                unit_divisor=1000,
                desc=label,
                smoothing=0.1,
                file=sys.stderr,
                **width,
            )
            set_active_bar(self._bar)

    def rates(self) -> tuple[float, float]:
        dt = max(time.monotonic() - self.t0, 1e-9)
        return self.tokens / dt, self.bytes / dt

    def update(self, docs: int, tokens: int, nbytes: int, raw_bytes: int = 0) -> None:
        self.docs += docs
        self.tokens += tokens
        self.bytes += nbytes
        if not self.enabled:
            return
        tps, bps = self.rates()
        if self._bar is not None:
            self._bar.update(raw_bytes)
            self._bar.set_postfix_str(
                f"{human_count(self.docs)} docs, {human_count(tps)} tok/s, {bps / 1e6:.2f} MB/s", refresh=False
            )
            return
        now = time.monotonic()
        if now - self._last >= self.interval:
            self._last = now
            log(
                f"{self.label}: {self.docs:,} docs, {human_count(self.tokens)} tokens, "
                f"{human_bytes(self.bytes)} text, {human_count(tps)} tok/s, {bps / 1e6:.2f} MB/s, "
                f"{now - self.t0:.0f} s"
            )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
            set_active_bar(None)
