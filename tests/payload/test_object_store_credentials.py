"""Where an object-store root and a step store get their credentials on a cloud machine: a web
identity token exchanged at STS, the instance metadata service, a profile of the shared AWS
files; and a credential that cannot be had is a typed error. The loopback stand-ins
(:mod:`tests.credential_servers`) issue the session's S3 server keys, so every request below
reaches the real server signed with what the chain found; nothing here passes keys."""

from __future__ import annotations

import numpy as np
import pytest

from rollfeed.loaders import RolloutDataset, write_step_file
from rollfeed.payload import PayloadRoot, PayloadWriter, read_fields
from rollfeed.payload.errors import PayloadStoreAuthError
from tests.credential_servers import ROLE_ARN, FakeMetadata, FakeSTS
from tests.loaders.common import write_batch
from tests.object_store_server import ACCESS_KEY, REGION, SECRET_KEY

ROWS = (np.arange(64).reshape(32, 2) % 7).astype(np.int64)


def _no_keys(monkeypatch, tmp_path) -> None:
    """No ``AWS_*`` variable and no shared AWS files: only what a test sets is found."""
    import os

    for name in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # botocore: no real metadata service


def _round_trip(url: str, tmp_path, **access) -> None:
    """A write read back, and a step written, listed and indexed, with ``access`` alone."""
    root = PayloadRoot(url, **access)
    with PayloadWriter(root, group="g", name="w") as w:
        segs = w.write({"routed_experts": ROWS}, pos=0)
    fresh = PayloadRoot(url, **access)
    got = read_fields(segs, {"routed_experts": (0, 32)}, root=fresh)["routed_experts"]
    assert np.array_equal(got.values.numpy(), ROWS)
    write_step_file(f"{url}/steps", 3, write_batch(tmp_path / "local", 2, seed=1), store=access)
    steps = RolloutDataset.from_step_dir(f"{url}/steps", store=access)
    assert steps.steps_from(0) == [3]  # the botocore-signed listing: the same credentials
    assert len(steps.lengths(3)) == 2


def test_a_web_identity_token_is_exchanged_at_sts_for_the_keys(
    object_store, s3_url, tmp_path, monkeypatch
):
    _no_keys(monkeypatch, tmp_path)
    token = tmp_path / "token"
    token.write_text("jwt-rollfeed")
    with FakeSTS(token="jwt-rollfeed", tls=True) as sts:
        monkeypatch.setenv("AWS_WEB_IDENTITY_TOKEN_FILE", str(token))
        monkeypatch.setenv("AWS_ROLE_ARN", ROLE_ARN)
        monkeypatch.setenv("AWS_ENDPOINT_URL_STS", sts.endpoint)
        monkeypatch.setenv("SSL_CERT_FILE", sts.ca_file)  # obstore trusts the fake's authority
        monkeypatch.setenv("AWS_CA_BUNDLE", sts.ca_file)  # and botocore
        _round_trip(s3_url, tmp_path, endpoint=object_store.endpoint, region=REGION)
        asked = [f for method, _, f in sts.seen if method == "POST"]
    assert asked and all(f["Action"] == "AssumeRoleWithWebIdentity" for f in asked)
    assert {f["WebIdentityToken"] for f in asked} == {"jwt-rollfeed"}


def test_instance_metadata_at_metadata_endpoint_gives_the_keys(
    object_store, s3_url, tmp_path, monkeypatch
):
    _no_keys(monkeypatch, tmp_path)
    monkeypatch.delenv("AWS_EC2_METADATA_DISABLED")
    with FakeMetadata() as imds:
        _round_trip(
            s3_url,
            tmp_path,
            endpoint=object_store.endpoint,
            region=REGION,
            metadata_endpoint=imds.endpoint,
        )
        seen = [(method, path) for method, path, _ in imds.seen]
    assert ("PUT", "/latest/api/token") in seen  # IMDSv2: a session token first
    assert ("GET", "/latest/meta-data/iam/security-credentials/rollfeed-reader") in seen


def test_a_profile_of_the_shared_files_gives_the_keys(object_store, s3_url, tmp_path, monkeypatch):
    pytest.importorskip("boto3", reason="profiles are read by boto3 (the object-store extra)")
    _no_keys(monkeypatch, tmp_path)
    files = tmp_path / "credentials"
    files.write_text(
        f"[rollfeed]\naws_access_key_id = {ACCESS_KEY}\naws_secret_access_key = {SECRET_KEY}\n"
    )
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(files))
    _round_trip(s3_url, tmp_path, endpoint=object_store.endpoint, region=REGION, profile="rollfeed")
    with pytest.raises(PayloadStoreAuthError, match="profile 'elsewhere'"):
        PayloadRoot(s3_url, endpoint=object_store.endpoint, profile="elsewhere").prune("g")


def test_a_credential_that_cannot_be_had_is_a_typed_error(
    object_store, s3_url, tmp_path, monkeypatch
):
    root = PayloadRoot(s3_url, **object_store.options())
    with PayloadWriter(root, group="g", name="w") as w:
        segs = w.write({"routed_experts": ROWS}, pos=0)
    _no_keys(monkeypatch, tmp_path)
    token = tmp_path / "token"
    token.write_text("jwt-expired")
    access = dict(endpoint=object_store.endpoint, region=REGION, request_retries=0)
    with FakeSTS(token="jwt-rollfeed", tls=True) as sts:  # the token is refused
        for k, v in {
            "AWS_WEB_IDENTITY_TOKEN_FILE": str(token),
            "AWS_ROLE_ARN": ROLE_ARN,
            "AWS_ENDPOINT_URL_STS": sts.endpoint,
            "SSL_CERT_FILE": sts.ca_file,
            "AWS_CA_BUNDLE": sts.ca_file,
        }.items():
            monkeypatch.setenv(k, v)
        with pytest.raises(PayloadStoreAuthError, match="no credential") as err:
            read_fields(segs, {"routed_experts": (0, 32)}, root=PayloadRoot(s3_url, **access))
        assert err.value.file == segs[0].file and err.value.field == "routed_experts"
        with pytest.raises(PayloadStoreAuthError, match=r"no credential for s3://"):
            RolloutDataset.from_step_dir(f"{s3_url}/steps", store=access).steps_from(0)
    for name in ("AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_ROLE_ARN"):
        monkeypatch.delenv(name)
    with FakeMetadata() as imds:  # a machine without a role
        imds.refuse = True
        no_role = PayloadRoot(s3_url, **access, metadata_endpoint=imds.endpoint)
        with pytest.raises(PayloadStoreAuthError, match="no credential") as err:
            read_fields(segs, {"routed_experts": (0, 32)}, root=no_role)
    assert SECRET_KEY not in str(err.value)
