"""The media family (:mod:`tests.payload.adversary_media`): stored images flipped, cut, grown or
swapped for a symlink, FIFO or directory, handles with wrong digests and sizes, image records and
samples at boundary values, encoded images mutated or claiming huge dimensions -- the exact bytes
or pixels, or a typed refusal; never the canary outside the root, never an allocation past the
bound."""

from tests.payload.adversary import format_summary, run_family
from tests.payload.adversary_tally import FAILURES


def test_media_attacks_read_exact_bytes_or_refuse_typed(tmp_path):
    # The image processor imports transformers (~2 GiB of address space); a decoded bomb of
    # 10^10 pixels would still be far past the bound.
    s = run_family("media", tmp_path, timeout_s=180, as_limit=3 << 30)
    print(format_summary(s))
    assert not {k: s[k] for k in FAILURES if s[k]}, format_summary(s)
    assert s["tried"] >= 850, format_summary(s)
    assert s["correct"] > 100 and s["refused"] > 300, format_summary(s)
