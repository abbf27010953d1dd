"""Fault test child: take 2 micro batches, save state, SIGKILL (or SIGSTOP) a worker, time the
error, then take the rest of the step from the same loader (its next pass starts new workers).

Run as ``python -m tests.loaders.kill_worker RUN_DIR OUT_JSON [thread|plain] [KILL|STOP]`` (with
or without the receive thread), with the default ``LoaderOptions`` bounds. It runs apart from
pytest since the DataLoader's SIGCHLD handler raises a worker's death asynchronously, wherever
the main thread is, and so that a wait without bound fails the test by the child's timeout.
"""

from __future__ import annotations

import faulthandler
import json
import multiprocessing
import os
import signal
import sys
import time

from rollfeed.collate import PlanConfig
from rollfeed.loaders import (
    LoaderConfig,
    LoaderOptions,
    RolloutDataset,
    Topology,
    WorkerError,
    build_dataloader,
)
from tests.loaders.common import SEQ_LEN


class SlowDataset(RolloutDataset):
    """Samples that take a while to load, as real-size ones do: the workers are still busy with
    this step when one is killed (tiny indexed samples load so fast that the whole step would be
    prefetched before the kill)."""

    def __getitems__(self, indices):
        time.sleep(0.05 * len(indices))
        return super().__getitems__(indices)


def main(run: str, out: str, mode: str = "thread", how: str = "KILL") -> None:
    faulthandler.dump_traceback_later(30, exit=True)  # a hang shows where, before the timeout
    ds = SlowDataset.from_step_dir(os.path.join(run, "steps"))
    topo = Topology(dp_rank=0, dp_size=1, cp_rank=1, cp_size=2)
    loader = build_dataloader(
        ds,
        topo,
        LoaderConfig(plan=PlanConfig(seq_len=SEQ_LEN, cp_size=2)),
        root=os.path.join(run, "payload"),
        options=LoaderOptions(num_workers=2, receive_depth=2 if mode == "thread" else 0),
    )
    it = iter(loader)
    taken = [next(it).input_ids.tolist() for _ in range(2)]
    state = loader.state_dict()
    result = {"state": state, "taken": taken, "error": None}
    t0 = time.monotonic()
    try:
        # workers hold prefetched tasks: mid-step
        os.kill(multiprocessing.active_children()[0].pid, getattr(signal, f"SIG{how}"))
        while True:
            next(it)
            result["after_kill"] = result.get("after_kill", 0) + 1
    except WorkerError as err:
        result.update(error=type(err).__name__, message=str(err), seconds=time.monotonic() - t0)
        result.update(worker=err.worker, step=err.step)
        result["rest"] = [t.input_ids.tolist() for t in loader]
    except Exception as err:  # anything else is what the test refuses
        result.update(error=type(err).__name__, message=str(err))
    except StopIteration:
        result.update(error="StopIteration")
    with open(out, "w") as f:
        json.dump(result, f)
    loader.close()  # the surviving worker is shut down with the loader's workers


if __name__ == "__main__":
    main(*sys.argv[1:])
