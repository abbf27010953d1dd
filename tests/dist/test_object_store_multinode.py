"""Two torchrun "nodes" on this machine (``--nnodes=2``, c10d rendezvous on 127.0.0.1), each in
its own working directory with no directory in common, DP 2 x CP 2, payload and step files only in
the object store (the session's SeaweedFS): every rank's micro batches equal, bitwise, the
single-process reference read from a local root."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import torch

from rollfeed.loaders import write_step_file
from rollfeed.payload import PayloadRoot
from tests.dist.launch import REPO
from tests.loaders.common import assert_bitwise, reference, write_batch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(180)
def test_two_nodes_read_only_from_the_store_equal_the_local_reference(
    tmp_path, object_store, s3_url
):
    local = write_batch(tmp_path / "payload", 19, seed=31)
    remote = write_batch(PayloadRoot(f"{s3_url}/payload", **object_store.options()), 19, seed=31)
    write_step_file(f"{s3_url}/steps", 0, remote, store=object_store.options())
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONPATH=str(REPO))
    env.update(object_store.env())
    nodes = []
    for node in (0, 1):
        work = tmp_path / f"node{node}"
        work.mkdir()
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=2"]
        cmd += [f"--node_rank={node}", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}"]
        cmd += ["--rdzv_id=object-store", str(REPO / "tests/dist/run_object_store_multinode.py")]
        cmd += [s3_url]
        out = open(work / "torchrun.log", "w")  # noqa: SIM115
        nodes.append((subprocess.Popen(cmd, cwd=work, env=env, stdout=out, stderr=out), work))
    for proc, work in nodes:
        try:
            rc = proc.wait(timeout=150)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert rc == 0, (work / "torchrun.log").read_text()[-6000:]
    assert (tmp_path / "node0" / "ok.json").exists()
    ref, _ = reference(local, dp_size=2, cp_size=2, cp_layout="zigzag", root=tmp_path / "payload")
    found = {}
    for node in (0, 1):
        for path in (tmp_path / f"node{node}").glob("out_dp*_cp*.pt"):
            dp, cp = (int(x[2:]) for x in path.stem[4:].split("_"))
            found[dp, cp] = (node, torch.load(path, weights_only=False))
    assert sorted(found) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert {found[0, 0][0], found[1, 0][0]} == {0, 1}  # each node ran one DP rank
    for key, (_, got) in found.items():
        assert len(got) == len(ref[key])
        for k, (a, b) in enumerate(zip(got, ref[key], strict=True)):
            assert_bitwise(a, b, (key, k))
