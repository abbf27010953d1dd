"""Object-store locations (pure): ``s3://bucket/prefix`` parsing, keys confined to the prefix
by the local root's rule, credentials kept out of ``repr``."""

import pickle

import pytest

from rollfeed.payload import PayloadInputError, PayloadPathError, PayloadRoot
from rollfeed.payload.stores.object_root import ObjectRoot
from rollfeed.payload.stores.store_url import StoreAccess, StoreURL, is_store_url


def test_parse_and_keys():
    url = StoreURL.parse("s3://rollouts/run7/payload/")
    assert (url.bucket, url.prefix) == ("rollouts", "run7/payload")
    assert url.key("step_1/w0-000001.rfp") == "run7/payload/step_1/w0-000001.rfp"
    assert url.rel("run7/payload/step_1/a.rfp") == "step_1/a.rfp"
    assert str(url) == "s3://rollouts/run7/payload"
    assert StoreURL.parse("s3://rollouts").key("a.rfp") == "a.rfp"
    assert is_store_url("s3://b/c") and not is_store_url("/tmp/s3:") and not is_store_url(3)


@pytest.mark.parametrize("bad", ["s3://ab/x", "s3://Upper/x", "s3://b_c/x", "gs://bucket/x"])
def test_bad_urls_are_refused(bad):
    with pytest.raises(PayloadInputError):
        StoreURL.parse(bad)


@pytest.mark.parametrize("bad", ["s3://bucket/a/../b", "s3://bucket/a//b/c"])
def test_prefixes_that_could_escape_are_refused(bad):
    with pytest.raises(PayloadPathError):
        StoreURL.parse(bad)


@pytest.mark.parametrize("handle", ["../x", "/abs", "a/../../x", "a//b", "a/./b", "a\\b", "a\0b"])
def test_handles_outside_the_prefix_are_refused(handle):
    with pytest.raises(PayloadPathError):
        StoreURL.parse("s3://bucket/p").key(handle)


def test_credentials_stay_out_of_repr_and_the_root_pickles_without_a_client():
    root = PayloadRoot("s3://bucket/p", access_key_id="AKIDSECRET1", secret_access_key="SK-ZZZ")
    assert isinstance(root, ObjectRoot)
    shown = repr(root) + repr(root.access) + repr(StoreAccess(secret_access_key="SK-ZZZ"))
    assert "SK-ZZZ" not in shown and "AKIDSECRET1" not in shown
    back = pickle.loads(pickle.dumps(root))
    assert isinstance(back, ObjectRoot) and back._state is None and back.path == "s3://bucket/p"


def test_endpoint_and_region_come_from_the_environment_when_not_given(monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")
    monkeypatch.setenv("AWS_REGION", "eu-west-1")
    got = StoreAccess(region="us-east-2").resolved()
    assert got == {"endpoint": "http://127.0.0.1:1", "region": "us-east-2"}
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    assert StoreAccess().resolved() == {
        "endpoint": "https://s3.eu-west-1.amazonaws.com",
        "region": "eu-west-1",
    }
