"""A producer's durable cursor: the cursor log beside the step files, replayed into its state.

:class:`RolloutCursor` opens the log of a step directory (:mod:`~rollfeed.orchestrator.cursor_log`:
a local directory or an object-store prefix), replays every record into a
:class:`~rollfeed.orchestrator.cursor_events.CursorState`, and then records each new event
durably *before* the producer acts on it (an event that contradicts the state is refused before
it is written). What the state holds after a crash is therefore a prefix of what happened:
everything recorded happened, and whatever happened after the last record (a turn answered but not
recorded, a step file put but not recorded) is either done again (the turn is sent again) or found
and adopted (the step file, checked sample by sample against the records).

``metrics``: ``records`` (read at open), ``torn_bytes`` (a torn tail cut off at open: the append a
crash interrupted), ``in_flight`` (turns sent and not answered when the last producer stopped:
sent again now).

Example::

    with RolloutCursor("/run/steps") as cursor:
        cursor.state.steps            # {0: StepState(...), 1: ...}
        cursor.record(StepBegun(step=2, prompts=["p8", "p9"], group_size=4))
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from rollfeed.orchestrator.cursor_events import CursorState, decode_event, encode_event
from rollfeed.orchestrator.cursor_log import open_log
from rollfeed.orchestrator.errors import CursorMismatchError


class RolloutCursor:
    """The cursor of step directory ``directory`` (see the module doc); one writer at a time
    (:class:`~rollfeed.orchestrator.errors.CursorInUseError` for a second)."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        store: Mapping[str, object] | None = None,
        fsync: bool = True,
    ) -> None:
        self.log = open_log(directory, store=store, fsync=fsync)
        try:
            self.state = CursorState(name=self.log.where)
            for seq, payload in enumerate(self.log.records):
                self.state.apply(decode_event(payload, seq=seq, name=self.log.where), seq)
        except BaseException:
            self.log.close()
            raise
        self.metrics = {
            "records": len(self.log.records),
            "torn_bytes": self.log.torn,
            "in_flight": len(self.state.in_flight()),
        }

    def record(self, event) -> int:
        """Record ``event`` durably, then add it to the state; its record number."""
        why = self.state.contradiction(event)
        if why is not None:
            raise CursorMismatchError(
                f"refusing to record {event.kind}: {why}", file=self.log.where, step=event.step
            )
        seq = self.log.append(encode_event(event))
        self.state.apply(event, seq)
        return seq

    def close(self) -> None:
        self.log.close()

    def __enter__(self) -> RolloutCursor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
