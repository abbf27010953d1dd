"""SIGKILL the trainer, the producer, both, or the capture server at seeded points, start them
again, and hold the run to its log: nothing lost, nothing duplicated, versions never fork, and
every step trained after a restart trained bitwise as a fresh process trains it from the same
checkpoint (:mod:`tests.crash.harness`, :mod:`tests.crash.audit`).

``test_crash_points`` (marked ``crash``): 20 kills, 1 of them of the capture server mid-reload
(the test owns one; a start costs 20-45 s), over a run of 30 steps. ``test_two_crash_points``:
the producer mid-append of its cursor, then the trainer and the producer at once with the trainer
mid-checkpoint, over 3 steps on the session's capture server, the step trained after the restart
checked with ``python -m rollfeed retrain`` while the trainer restarts. Both print the table of
the run (the seconds of each phase on its last line) and find no process of the run left once it
is closed (a killed torchrun's ranks included).
"""

from __future__ import annotations

import json
import sys

import pytest

from rollfeed.capture.process import free_port, server_process
from tests.conftest import MAX_LOGPROBS, START_TIMEOUT_S, restore_base_weights
from tests.crash.harness import (
    Kill,
    Pipeline,
    Settings,
    leftovers,
    plan_kills,
    replay_records,
    start_replays,
    table,
)

SEED = 7


def check_bitwise(pipeline: Pipeline, lineage: list[dict], again: dict[int, dict]) -> int:
    for c, record in again.items():
        mine = lineage[c]
        assert record["step"] == c == mine["step"]
        assert record["digest"] == mine["digest"], f"step {c} trained again differs"
        assert record["loss"] == mine["loss"] and record["samples"] == mine["samples"], c
    return len(again)


@pytest.mark.vllm
@pytest.mark.timeout(240)
def test_two_crash_points(capture_server, tmp_path):
    settings = Settings(steps=3, seed=SEED)
    pipeline = Pipeline(
        tmp_path,
        capture_server.model_dir,
        settings,
        url=capture_server.url,
        root=capture_server.root,
        group_prefix=f"crash-{tmp_path.name}/",
    )
    kills = [
        Kill(target="producer", point="cursor.torn", after=3),
        Kill(target="both", point="checkpoint.mid", after=1),
    ]
    restored = False
    try:
        # The trainer starts first (it waits for step 0's file) while the server is given the
        # model's own weights, version 0, as the run starts from; then the producer.
        pipeline.start("trainer")
        restore_base_weights(capture_server.url, capture_server.model_dir, tmp_path)
        pipeline.start("producer")
        replay = []

        def retrain() -> None:
            """The first step trained after the trainer's restart, trained again with the
            command line from the same checkpoint while the trainer restarts."""
            c = min(pipeline.tally.resumed_from)
            pipeline.wait_step_file(c)
            cmd = [sys.executable, "-m", "rollfeed", "retrain", "--steps", str(pipeline.steps)]
            cmd += ["--root", str(pipeline.root), "--checkpoints", str(tmp_path / "checkpoints")]
            cmd += ["--model", str(capture_server.model_dir), "--from", str(c), "--to", str(c)]
            cmd += ["--out", str(tmp_path / "again.json"), "--lr", "1e-4", "--seq-len", "32"]
            cmd += ["--cp", "1", "--max-staleness", "1", "--on-stale", "drop"]
            replay.append(pipeline.background("retrain", cmd))

        pipeline.do(kills[0])
        pipeline.do(kills[1], restarted=retrain)
        final, lineage = pipeline.finish()
        # The session's server back at the model's weights while the step trains again.
        restore_base_weights(capture_server.url, capture_server.model_dir, tmp_path)
        restored = True
        pipeline.wait_background(replay[0], "retrain")
    finally:
        pipeline.close()
        if not restored:
            restore_base_weights(capture_server.url, capture_server.model_dir, tmp_path)
    # Every process the run started ended with it: a killed torchrun's ranks too.
    assert not leftovers(tmp_path), leftovers(tmp_path)
    c = min(pipeline.tally.resumed_from)
    again = {c: json.loads((tmp_path / "again.json").read_text())["train"][0]}
    bitwise = check_bitwise(pipeline, lineage, again)
    print(table(pipeline.tally, final, bitwise=bitwise, seed=SEED, steps=settings.steps))
    assert final.steps_trained == settings.steps and final.lost == final.duplicated == 0
    assert final.produced == settings.steps * 6 == final.trained + final.dropped


@pytest.mark.crash
@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_crash_points(tiny_model, tmp_path):
    model_dir, _ = tiny_model
    settings = Settings(steps=30, seed=SEED)
    port = free_port()
    args = ["--dtype", "float32", "--max-model-len", "512", "--max-num-seqs", "4", "--seed", "0"]
    args += ["--max-logprobs", str(MAX_LOGPROBS), "--enforce-eager", "--disable-uvicorn-access-log"]

    def start_server(port: int):
        return server_process(
            tmp_path / "payload",
            model_dir,
            log=tmp_path / "server.log",
            serve_args=args,
            start_timeout_s=START_TIMEOUT_S,
            port=port,
        )

    pipeline = Pipeline(
        tmp_path,
        model_dir,
        settings,
        url=f"http://127.0.0.1:{port}",
        root=tmp_path / "payload",
        start_server=start_server,
    )
    kills = plan_kills(SEED, 20, server=1)
    try:
        # The trainer starts while the server does (it waits for step 0's file).
        pipeline.start("trainer")
        pipeline.start_owned_server()
        pipeline.start("producer")
        for kill in kills:
            pipeline.do(kill)
        starts = sorted(pipeline.tally.resumed_from)
        replays = start_replays(pipeline, starts)
        final, lineage = pipeline.finish()
        again = replay_records(pipeline, replays, starts)
    finally:
        pipeline.close()
    assert not leftovers(tmp_path), leftovers(tmp_path)
    bitwise = check_bitwise(pipeline, lineage, again)
    print(table(pipeline.tally, final, bitwise=bitwise, seed=SEED, steps=settings.steps))
    assert sum(pipeline.tally.kills.values()) == 20
    assert pipeline.tally.kills["server reload.mid"] == 1
    assert final.steps_trained == settings.steps and final.lost == final.duplicated == 0
    assert final.produced == settings.steps * 6 == final.trained + final.dropped
