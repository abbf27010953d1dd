"""The crash test's producer: :class:`rollfeed.orchestrator.Producer` with the test's pause points.

``python tests/crash/run_producer.py CONFIG.json``: the prompts (synthetic token ids), the group
size, the steps, ``max_ahead``, the capture server and the step directory come from the JSON the
test writes. ``sync`` loads the trainer's newest complete weights into the server whenever the
server's policy version is not the progress file's (``in_flight="continue"``: rollouts in flight
go on under the new weights and span two versions).

Pause points (:mod:`tests.crash.points`): ``cursor.torn`` (half a cursor record written and
synced, the rest not), ``step.mid_write`` (a step file staged with some samples),
``step.after_commit`` (a step file in place, its record not yet in the cursor), ``reload.mid`` (a
weight reload sent to the server, not yet answered; armed with ``release``, it goes on when the
test says so).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np

from rollfeed.loaders import StepWriter
from rollfeed.orchestrator import CaptureClient, Producer, ProducerConfig
from rollfeed.orchestrator import producer as producer_module
from rollfeed.orchestrator.cursor_frames import frame
from rollfeed.orchestrator.cursor_log import LocalLog
from rollfeed.orchestrator.groups import Prompt
from tests.crash.points import Points

POINTS = Points("producer")


def prompts(count: int, seed: int) -> list[Prompt]:
    rng = np.random.default_rng(seed)
    return [
        Prompt(id=f"q{i}", token_ids=(1, *rng.integers(10, 900, int(rng.integers(3, 8))).tolist()))
        for i in range(count)
    ]


def reward(prompt, rollout) -> float:
    sampled = np.asarray(rollout.token_ids)[np.asarray(rollout.loss_mask, dtype=bool)]
    return float((sampled % 2 == 0).mean()) if sampled.size else 0.0


def install_points() -> None:
    append = LocalLog.append

    def torn_append(self, payload):
        if POINTS.due("cursor.torn"):
            data = frame(len(self.records), payload)
            os.pwrite(self.fd, data[: len(data) // 2], self.end)
            os.fsync(self.fd)
            POINTS.pause("cursor.torn")
        return append(self, payload)

    LocalLog.append = torn_append
    sample_append = StepWriter.append

    def staged_append(self, *args, **kwargs):
        sample_append(self, *args, **kwargs)
        POINTS.at("step.mid_write")

    StepWriter.append = staged_append
    put_step = producer_module.put_step

    def committed(*args, **kwargs):
        adopted = put_step(*args, **kwargs)
        POINTS.at("step.after_commit")
        return adopted

    producer_module.put_step = committed


def make_sync(client: CaptureClient):
    def sync(progress) -> None:
        if progress is None or progress.weights is None:
            return
        if client.info().policy_version == progress.version:
            return
        if not POINTS.due("reload.mid"):
            client.load_weights(progress.weights, version=progress.version, in_flight="continue")
            return
        failed: list[BaseException] = []

        def load() -> None:
            try:
                client.load_weights(
                    progress.weights, version=progress.version, in_flight="continue"
                )
            except BaseException as err:
                failed.append(err)

        thread = threading.Thread(target=load)
        thread.start()
        time.sleep(0.05)  # the request is at the server
        POINTS.pause("reload.mid")
        thread.join()
        if failed:
            raise failed[0]

    return sync


def main(path: str) -> None:
    POINTS.mark("imported")
    cfg = json.loads(Path(path).read_text())
    install_points()
    client = CaptureClient(cfg["server"], timeout_s=120)
    config = ProducerConfig(
        group_size=cfg["group_size"],
        prompts_per_step=cfg["prompts_per_step"],
        sampling={"top_k": 20, "top_p": 0.9, "temperature": 0.9, "max_tokens": cfg["max_tokens"]}
        | {"seed": cfg["seed"]},
        max_ahead=cfg["max_ahead"],
        steps=cfg["steps"],
        concurrency=4,
        group_prefix=cfg["group_prefix"],
        server_wait_s=300.0,
    )
    items = prompts(cfg["steps"] * cfg["prompts_per_step"], cfg["seed"])
    metrics = Producer(
        client, cfg["steps_dir"], items, reward=reward, config=config, sync=make_sync(client)
    ).run()
    print(json.dumps(metrics), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
