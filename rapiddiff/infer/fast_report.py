"""What each fast-path switch did: a typed status per switch, rendered as text for people.

Code (the compile-cache name, the AOTInductor package key) reads :meth:`FastPathReport.status`;
``pipe.report[name]`` is the rendered line ("on (12 attention layers)", "fallback: <reason>").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rapiddiff.utils.logging import get_logger

log = get_logger(__name__)

State = Literal["on", "off", "fallback"]


@dataclass(frozen=True)
class SwitchStatus:
    """``state``; ``value``: what was applied (shown instead of "on", e.g. "float16", "graph") or,
    for a fallback, what runs instead; ``reason``: the detail (on) or why it could not apply."""

    state: State
    value: str = ""
    reason: str = ""

    def __post_init__(self) -> None:
        if self.state not in ("on", "off", "fallback"):
            raise ValueError(f"state must be on, off or fallback; got {self.state!r}")

    @property
    def on(self) -> bool:
        return self.state == "on"

    def __str__(self) -> str:
        detail = f" ({self.reason})" if self.reason else ""
        if self.state == "fallback":
            return f"fallback: {self.value}{detail}" if self.value else f"fallback: {self.reason}"
        head = self.value or self.state
        return head + detail


ON, OFF = SwitchStatus("on"), SwitchStatus("off")


def fallback(reason: str, instead: str = "") -> SwitchStatus:
    """A switch that could not apply here: ``instead`` is what runs in its place."""
    return SwitchStatus("fallback", instead, reason)


class FastPathReport(dict[str, str]):
    """switch → rendered status (a plain dict for people, logs and JSON), with the typed
    :class:`SwitchStatus` of each behind :meth:`status`. Set entries with :meth:`set` only."""

    def __init__(self) -> None:
        super().__init__()
        self._statuses: dict[str, SwitchStatus] = {}

    def set(self, name: str, status: SwitchStatus, *, quiet: bool = False) -> None:
        self._statuses[name] = status
        self[name] = str(status)
        if status.state == "fallback":
            log.warning("accelerate: %s → %s", name, status)
        elif not quiet:
            log.info("accelerate: %s → %s", name, status)

    def status(self, name: str) -> SwitchStatus:
        """The typed status of ``name`` (off when the switch never reported)."""
        return self._statuses.get(name, OFF)

    def is_on(self, name: str) -> bool:
        return self.status(name).on

    def line(self) -> str:
        """The report as one line a log or a table can carry."""
        return "; ".join(f"{k}: {v}" for k, v in self.items())
