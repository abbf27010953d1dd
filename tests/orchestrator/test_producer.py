"""The producer's logic against a stand-in client: a producer stopped anywhere and started again
writes the steps one never stopped writes, samples no finished rollout again, adopts a step file it
put but did not record, holds its turns through a server outage, stays max_ahead steps ahead of the
trainer and refuses a cursor it cannot continue."""

import os
import threading
import time

import numpy as np
import pytest

from rollfeed.capture.protocol import CompletionRecord, GenerateResponse
from rollfeed.loaders import read_step_file, write_step_file
from rollfeed.orchestrator import Producer, ProducerConfig
from rollfeed.orchestrator.cursor_events import RolloutState, StepState
from rollfeed.orchestrator.cursor_frames import frame, scan
from rollfeed.orchestrator.cursor_log import FOLDER, LOG_NAME
from rollfeed.orchestrator.errors import CursorMismatchError
from rollfeed.orchestrator.groups import Prompt
from rollfeed.orchestrator.progress import TrainerProgress, read_progress, write_progress
from rollfeed.orchestrator.step_output import put_step, step_samples
from rollfeed.payload import ImageSpan
from tests.orchestrator.fake_client import Crash, FakeClient

PROMPTS = [Prompt(id=f"p{i}", token_ids=(1, 2, 3 + i)) for i in range(6)]
CONFIG = ProducerConfig(
    group_size=2, prompts_per_step=2, sampling={"top_k": 5, "seed": 7}, max_ahead=10
)


def reward(prompt, rollout):
    return float(sum(rollout.token_ids) % 5)


def two_turns(prompt, rollout):
    return [9, 9] if len(rollout.turns) == 1 else None


def producer(client, directory, **kwargs):
    options = {"reward": reward, "config": CONFIG} | kwargs
    return Producer(client, directory, PROMPTS, **options)


def steps_of(directory, count=3):
    out = []
    for k in range(count):
        samples = read_step_file(os.path.join(directory, f"step_{k:06d}.rfs"))
        out.append([(s.uid, s.token_ids.tolist(), s.advantages.tolist()) for s in samples])
    return out


@pytest.mark.parametrize("crash_after", [1, 4, 7, 12])
@pytest.mark.parametrize("next_turn", [None, two_turns], ids=["one_turn", "two_turns"])
def test_a_producer_stopped_anywhere_resumes_to_the_same_steps(tmp_path, crash_after, next_turn):
    reference = FakeClient()
    producer(reference, tmp_path / "ref", next_turn=next_turn).run()
    first = FakeClient(crash_after=crash_after)
    with pytest.raises(Crash):
        producer(first, tmp_path / "run", next_turn=next_turn).run()
    second = FakeClient()
    metrics = producer(second, tmp_path / "run", next_turn=next_turn).run()
    assert steps_of(tmp_path / "run") == steps_of(tmp_path / "ref")
    # Every turn recorded as answered before the crash is not asked again; only the ones in
    # flight (sent, answer not recorded) are, once each.
    assert set(first.served) | set(second.served) == set(reference.served)
    assert len(set(first.served) & set(second.served)) <= metrics["resent"]
    assert len(second.served) == len(set(second.served))


def test_each_rollout_is_finished_once_across_a_crash(tmp_path):
    first = FakeClient(crash_after=6)
    with pytest.raises(Crash):
        producer(first, tmp_path).run()
    done_before = sum(1 for _ in _records(tmp_path, b'"finished"'))
    metrics = producer(FakeClient(), tmp_path).run()
    assert done_before + metrics["rollouts"] == 12  # 3 steps x 2 prompts x 2 samples
    assert sum(1 for _ in _records(tmp_path, b'"finished"')) == 12


def _records(directory, kind):
    for payload in scan((directory / FOLDER / LOG_NAME).read_bytes()).payloads:
        if kind in payload:
            yield payload


def test_a_torn_cursor_tail_costs_only_the_record_it_held(tmp_path):
    with pytest.raises(Crash):
        producer(FakeClient(crash_after=5), tmp_path).run()
    with open(tmp_path / FOLDER / LOG_NAME, "ab") as f:
        f.write(frame(10_000, b'{"event": {"kind": "begun"')[:21])
    metrics = producer(FakeClient(), tmp_path).run()
    assert metrics["torn_bytes"] == 21
    producer(FakeClient(), tmp_path / "ref").run()
    assert steps_of(tmp_path) == steps_of(tmp_path / "ref")


def _cut_before_last_written(directory):
    """The log as a producer killed after putting its last step file, before recording it."""
    path = directory / FOLDER / LOG_NAME
    data = path.read_bytes()
    at = data.rfind(b"RFC1")
    assert b'"written"' in data[at:]
    path.write_bytes(data[:at])


def test_a_step_file_put_but_not_recorded_is_adopted_never_replaced(tmp_path):
    producer(FakeClient(), tmp_path).run()
    step = tmp_path / "step_000002.rfs"
    before = os.stat(step)
    _cut_before_last_written(tmp_path)
    client = FakeClient()
    metrics = producer(client, tmp_path).run()
    assert metrics["steps_adopted"] == 1 and metrics["steps_written"] == 0
    assert client.calls == 0
    after = os.stat(step)
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def test_a_step_file_that_is_not_the_recorded_rollouts_is_refused(tmp_path):
    producer(FakeClient(), tmp_path).run()
    samples = read_step_file(tmp_path / "step_000002.rfs")
    _cut_before_last_written(tmp_path)
    write_step_file(tmp_path, 2, samples[:3])
    with pytest.raises(CursorMismatchError) as err:
        producer(FakeClient(), tmp_path).run()
    assert err.value.step == 2


def test_a_server_outage_holds_the_turns_and_syncs_before_sending_them_again(tmp_path):
    client = FakeClient(down={3})
    synced = []

    def sync(progress):
        synced.append(client.calls)
        client.up()  # the server came back (a restarted one answers info)

    metrics = producer(client, tmp_path, sync=sync).run()
    producer(FakeClient(), tmp_path / "ref").run()
    assert steps_of(tmp_path) == steps_of(tmp_path / "ref")
    assert metrics["outages"] == 1 and metrics["retried"] >= 1
    assert len(synced) >= 2  # before the first request, and after the outage


def test_the_producer_stays_max_ahead_steps_ahead_of_the_trainer(tmp_path):
    config = ProducerConfig(group_size=2, prompts_per_step=2, sampling={"top_k": 5}, max_ahead=1)
    seen = []
    p = producer(FakeClient(), tmp_path, config=config)
    thread = threading.Thread(target=lambda: seen.append(p.run()))
    thread.start()
    for trained in range(3):
        deadline = time.monotonic() + 20
        want = min(trained + 1, 2)  # steps 0..trained+1 may be written, never more
        while not (tmp_path / f"step_{want:06d}.rfs").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.3)  # a producer that ran ahead would have written the next one by now
        files = sorted(f.name for f in tmp_path.glob("step_*.rfs"))
        assert files == [f"step_{k:06d}.rfs" for k in range(want + 1)], trained
        write_progress(tmp_path, TrainerProgress(step=trained + 1, version=trained + 1))
    thread.join(timeout=20)
    assert seen and seen[0]["steps_written"] == 3
    assert read_progress(tmp_path).step == 3


def test_a_cursor_of_other_prompts_is_refused(tmp_path):
    with pytest.raises(Crash):
        producer(FakeClient(crash_after=6), tmp_path).run()
    other = [PROMPTS[0], PROMPTS[2], PROMPTS[1], *PROMPTS[3:]]
    with pytest.raises(CursorMismatchError) as err:
        Producer(FakeClient(), tmp_path, other, reward=reward, config=CONFIG).run()
    assert err.value.step == 0 and err.value.prompt == "p1"
    bigger = ProducerConfig(group_size=3, prompts_per_step=2, sampling={"top_k": 5})
    with pytest.raises(CursorMismatchError):
        producer(FakeClient(), tmp_path, config=bigger).run()


def test_a_step_file_the_cursor_never_began_is_refused(tmp_path):
    producer(FakeClient(), tmp_path / "a").run()
    stray = read_step_file(tmp_path / "a" / "step_000000.rfs")
    write_step_file(tmp_path / "b", 0, stray)
    with pytest.raises(CursorMismatchError) as err:
        producer(FakeClient(), tmp_path / "b").run()
    assert err.value.step == 0


def test_advantages_are_normalised_within_each_group(tmp_path):
    producer(FakeClient(), tmp_path).run()
    for step in steps_of(tmp_path):
        for g in range(2):
            adv = [a[-1] for _, _, a in step[2 * g : 2 * g + 2]]
            assert np.isclose(sum(adv), 0.0, atol=1e-6)
            assert all(abs(abs(x) - 1.0) < 1e-5 for x in adv) or adv == [0.0, 0.0]


def test_rollouts_with_images_keep_their_group_but_claim_no_shared_prefix(tmp_path):
    """Samples with images are not packed as trees, so their records claim no prompt prefix (the
    step writer refuses one that does); text rollouts of the same step claim theirs."""

    def answered(images: list[ImageSpan]) -> RolloutState:
        c = CompletionRecord(
            index=0,
            token_ids=[7, 8],
            logprobs=[-0.1, -0.2],
            trainable=[True, True],
            finish_reason="length",
            new_prompt_len=6,
            segments=[],
            metrics={},
        )
        response = GenerateResponse(
            request_id="r", prompt_start=0, temperature=1.0, completions=[c], images=images
        )
        return RolloutState(turns=[([1, 2, 3, 4, 5, 6], response)], reward=1.0)

    image = ImageSpan(start=1, tokens=2, grid=(1, 2, 4), data=b"png")
    rollouts = {("p", s): answered([image]) for s in range(2)}
    rollouts |= {("q", s): answered([]) for s in range(2)}
    state = StepState(prompts=["p", "q"], group_size=2, rollouts=rollouts)
    samples = step_samples(state, {"p": 6, "q": 6})
    got = [(s.group, s.shared_prefix) for s in samples]
    assert got == [("p", 0), ("p", 0), ("q", 6), ("q", 6)]
    put_step(tmp_path, 0, samples, fsync=False)
    assert [len(s.images) for s in read_step_file(tmp_path / "step_000000.rfs")] == [1, 1, 0, 0]
