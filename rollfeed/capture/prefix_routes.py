"""A group's shared prompt routes written once: every completion's records point at one copy.

The completions of one request (``n > 1``) share their prompt, and the engine routes a prompt
token once (prefill), so their routed rows over the prompt are the same bytes. Separate requests
of one group with the same prompt share them too when the engine routes alike (its prefix cache
hit, or a deterministic prefill). Writing each completion's copy stores the prompt's routes
``n`` times (384 B per token at 48 layers x top-8: a 2k prompt in a group of 8 is 5.5 MiB, 4.8
MiB of them copies). Here:

- :func:`shared_rows`: how many leading routed rows every completion of a request agrees on,
  compared by bytes (the prompt's rows, normally all of them);
- :class:`PromptRoutes`: the records of prompt routes already written in a group, keyed by the
  prompt's tokens, turn start and the rows' digest (bytes, so a request whose prompt routed
  otherwise writes its own), bounded (oldest dropped first);

:func:`~rollfeed.capture.capture_request_output` writes the shared rows once (or finds them in a
:class:`PromptRoutes`) and passes their records to every completion, whose segments then name the
same prompt bytes: the trainer's tree packing reads them once per prefix
(:mod:`rollfeed.collate.to_tensor_tree` confirms identity by record).

Example, a request of 4 completions with a 2048-token prompt, 48 layers x top-8, completions of
512: today 4 x (2047 + 511) rows; written once: 2048 + 4 x 510 rows (the last prompt row is the
input of each completion's first token, shared too).
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from rollfeed.payload import PayloadSegment


def shared_rows(routed: Sequence[np.ndarray], prompt_rows: int) -> int:
    """Leading rows (at most ``prompt_rows``) on which every array of ``routed`` holds the same
    values; 0 for fewer than two arrays or any mismatch in shape."""
    if len(routed) < 2:
        return 0
    first = np.asarray(routed[0])
    n = min(prompt_rows, *(len(r) for r in routed))
    if n <= 0:
        return 0
    same = np.ones(n, bool)
    for other in routed[1:]:
        other = np.asarray(other)
        if other.shape[1:] != first.shape[1:]:
            return 0
        same &= (other[:n] == first[:n]).reshape(n, -1).all(-1)
    return n if same.all() else int(np.argmin(same))


class PromptRoutes:
    """Records of prompt routes a group's writer already holds (see the module doc). Safe to
    share between threads; two requests that miss at once each write their own copy."""

    def __init__(self, max_entries: int = 256) -> None:
        self.max_entries = max_entries
        self._seen: OrderedDict[bytes, tuple[PayloadSegment, ...]] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0

    @staticmethod
    def key(prompt_ids: np.ndarray, prompt_start: int, rows: np.ndarray) -> bytes:
        digest = hashlib.sha256()
        digest.update(np.int64(prompt_start).tobytes())
        digest.update(np.ascontiguousarray(prompt_ids, np.int64).tobytes())
        digest.update(str((rows.dtype.str, rows.shape)).encode())
        digest.update(np.ascontiguousarray(rows).tobytes())
        return digest.digest()

    def get(self, key: bytes) -> tuple[PayloadSegment, ...] | None:
        with self._lock:
            found = self._seen.get(key)
            if found is not None:
                self._seen.move_to_end(key)
                self.hits += 1
            return found

    def put(self, key: bytes, segments: Sequence[PayloadSegment]) -> None:
        with self._lock:
            self._seen[key] = tuple(segments)
            self._seen.move_to_end(key)
            while len(self._seen) > self.max_entries:
                self._seen.popitem(last=False)
