"""The cursor log: frames, a torn tail cut off at every byte, damage refused, one writer."""

import os

import pytest

from rollfeed.orchestrator.cursor_frames import HEADER, frame, one_record, scan
from rollfeed.orchestrator.cursor_log import LocalLog, ObjectLog
from rollfeed.orchestrator.errors import CursorCorruptError, CursorInUseError

PAYLOADS = [b'{"a": 1}', b"{}", b'{"b": "' + b"x" * 300 + b'"}']


def log_bytes(payloads=PAYLOADS) -> bytes:
    return b"".join(frame(i, p) for i, p in enumerate(payloads))


def test_scan_reads_back_what_was_framed():
    found = scan(log_bytes())
    assert found.payloads == PAYLOADS and found.torn == 0 and found.end == len(log_bytes())
    assert scan(b"").payloads == []


def test_a_torn_last_record_is_cut_off_at_every_byte():
    whole = log_bytes()
    last = len(frame(2, PAYLOADS[2]))
    for cut in range(1, last):
        data = whole[: len(whole) - cut]
        found = scan(data)
        assert found.payloads == PAYLOADS[:2], cut
        assert found.torn == last - cut and found.end == len(whole) - last


def test_zeros_after_the_last_record_are_a_torn_tail():
    # A machine crash can leave the file longer than what was written, filled with zeros.
    found = scan(log_bytes() + bytes(100))
    assert found.payloads == PAYLOADS and found.torn == 100


@pytest.mark.parametrize("where", ["magic", "size", "seq", "crc", "payload"])
def test_damage_before_a_whole_record_is_refused_naming_it(where):
    data = bytearray(log_bytes())
    at = len(frame(0, PAYLOADS[0]))  # record 1
    offset = {"magic": 0, "size": 4, "seq": 8, "crc": 16, "payload": HEADER.size}[where]
    data[at + offset] ^= 0x40
    with pytest.raises(CursorCorruptError) as err:
        scan(bytes(data), name="log.rfc")
    assert err.value.record == 1 and err.value.offset == at and err.value.file == "log.rfc"


def test_a_record_removed_from_the_middle_is_refused():
    # The record after the gap is whole but numbered one too high: a crash never leaves that.
    data = frame(0, b"{}") + frame(2, b"{}") + frame(3, b"{}")
    with pytest.raises(CursorCorruptError) as err:
        scan(data)
    assert err.value.record == 1 and err.value.offset == len(frame(0, b"{}"))


def test_a_whole_record_is_never_a_torn_tail():
    with pytest.raises(CursorCorruptError):
        scan(log_bytes() + frame(7, b"{}"))


def test_a_record_out_of_order_is_refused():
    data = frame(0, b"{}") + frame(2, b"{}") + frame(2, b"{}")
    with pytest.raises(CursorCorruptError) as err:
        scan(data)
    assert err.value.record == 1


def test_an_object_holds_exactly_one_record():
    assert one_record(frame(3, b"{}"), seq=3, name="o") == b"{}"
    for bad in (frame(3, b"{}") + b"x", frame(4, b"{}"), frame(3, b"{}")[:-1]):
        with pytest.raises(CursorCorruptError):
            one_record(bad, seq=3, name="o")


def test_local_log_reopens_after_a_torn_append(tmp_path):
    log = LocalLog(tmp_path)
    assert [log.append(p) for p in PAYLOADS] == [0, 1, 2]
    log.close()
    path = tmp_path / "cursor" / "log.rfc"
    with open(path, "ab") as f:  # what a crash in the middle of an append leaves
        f.write(frame(3, b'{"c": 3}')[:13])
    log = LocalLog(tmp_path)
    assert log.records == PAYLOADS and log.torn == 13
    assert os.path.getsize(path) == len(log_bytes())  # cut off, so the next append follows
    assert log.append(b'{"d": 4}') == 3
    log.close()
    again = LocalLog(tmp_path)
    assert again.records == [*PAYLOADS, b'{"d": 4}'] and again.torn == 0
    again.close()


def test_local_log_has_one_writer(tmp_path):
    first = LocalLog(tmp_path)
    with pytest.raises(CursorInUseError):
        LocalLog(tmp_path)
    first.close()
    LocalLog(tmp_path).close()  # the lock goes with its holder


def test_object_log_puts_one_object_per_record_and_fences_a_second_writer(object_store, s3_url):
    opts = object_store.options()
    keys = ("endpoint", "access_key_id", "secret_access_key", "region")
    options = {"store": {k: opts[k] for k in keys}}
    log = ObjectLog(s3_url, **options)
    assert [log.append(p) for p in PAYLOADS] == [0, 1, 2]
    other = ObjectLog(s3_url, **options)
    assert other.records == PAYLOADS
    assert log.append(b'{"d": 4}') == 3
    with pytest.raises(CursorInUseError) as err:
        other.append(b'{"e": 5}')  # record 3 exists: another producer wrote it
    assert err.value.record == 3
    assert ObjectLog(s3_url, **options).records == [*PAYLOADS, b'{"d": 4}']
