"""End-to-end: a run that joins a running two-node Ray cluster (`executor.ray_address`) from
another directory keeps everything it writes under the driver's `runs_dir`, relative or not.

The cluster is `ray.cluster_utils.Cluster` (a head and one more node on this host), started in
a directory of its own: Ray's workers inherit that directory, so a relative path handed to a
rank lands there, not beside the driver (the bug this guards: an empty `final/`, a manifest of
only what arrived, a resume that blamed the backend)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.extended]  # a cluster shape


@pytest.fixture
def two_node_cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from ray.cluster_utils import Cluster

    cluster_cwd = tmp_path / "cluster-cwd"
    cluster_cwd.mkdir()
    ray_tmp = tempfile.mkdtemp(prefix="rt-", dir="/tmp")  # short: Ray's socket paths
    monkeypatch.setenv("RAY_TMPDIR", ray_tmp)
    monkeypatch.chdir(cluster_cwd)  # the raylets, and so every Ray worker, start here
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "include_dashboard": False},
    )
    cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    try:
        yield cluster, cluster_cwd, ray_tmp
    finally:
        cluster.shutdown()
        shutil.rmtree(ray_tmp, ignore_errors=True)


def test_joined_cluster_writes_the_run_where_the_driver_is(
    two_node_cluster, roll, tiny_recipe, tmp_path: Path
) -> None:
    cluster, cluster_cwd, ray_tmp = two_node_cluster
    driver_cwd = tmp_path / "driver"
    driver_cwd.mkdir()
    recipe = tiny_recipe(
        runs_dir="runs",  # relative, as the default: the driver's ./runs
        executor={"type": "ray", "ray_address": cluster.address},
        actor_train={
            "backend": "fsdp2",
            "num_threads": 1,
            "world_size": 2,
            "optim": {"lr": 3.0e-3},
        },
        trainer={"max_steps": 4, "micro_batch_size": 8, "grad_accum_steps": 1},
        eval={"every_steps": 100, "exact_match": False},
        checkpoint={"every_steps": 2, "keep_last": 2},
    )
    env = {"RAY_TMPDIR": ray_tmp}
    res = roll("sft", str(recipe), "--run-id", "two-node-00", cwd=driver_cwd, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    run_dir = driver_cwd / "runs" / "two-node-00"
    assert (run_dir / "final" / "model.safetensors").is_file()
    assert not (cluster_cwd / "runs").exists()  # nothing landed beside the cluster
    step = run_dir / "checkpoints" / "step-000004"
    manifest = json.loads((step / "manifest.json").read_text())
    assert any(name.startswith("actor_train/") for name in manifest["files"]), manifest

    res = roll("resume", "two-node-00", "trainer.max_steps=6", cwd=driver_cwd, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    meta = json.loads((run_dir / "meta.json").read_text())
    assert meta["status"] == "finished" and meta["step"] == 6
    assert (run_dir / "checkpoints" / "step-000006" / "manifest.json").is_file()
    assert not (cluster_cwd / "runs").exists()


def test_a_run_dir_the_ranks_cannot_see_is_refused_before_training(
    roll, tiny_recipe, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ranks on a node that does not share the driver's filesystem would write checkpoints and
    the final model onto their own disk: refused before the first step, naming the host and
    runs_dir. The node is a `ray start` in a mount namespace of its own where runs_dir is an
    empty tmpfs (what such a node sees); the head has no CPUs, so every rank lands there."""
    from ray.cluster_utils import Cluster

    if shutil.which("unshare") is None:
        pytest.skip("needs util-linux's unshare")
    hidden = tmp_path / "runs"
    hidden.mkdir()
    ray_tmp = tempfile.mkdtemp(prefix="rt-", dir="/tmp")
    monkeypatch.setenv("RAY_TMPDIR", ray_tmp)
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 0, "include_dashboard": False},
    )
    ray_cli = str(Path(sys.executable).parent / "ray")
    start = f"mount -t tmpfs none {hidden} && exec {ray_cli} start --address={cluster.address} --num-cpus=2 --block"
    node = subprocess.Popen(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", start],
        env={**os.environ, "RAY_TMPDIR": ray_tmp},
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_for_cpus(cluster.address, ray_tmp, 2)
        recipe = tiny_recipe(
            executor={"type": "ray", "ray_address": cluster.address},
            trainer={"max_steps": 2, "micro_batch_size": 8, "grad_accum_steps": 1},
            eval={"every_steps": 100, "exact_match": False},
        )
        res = roll("sft", str(recipe), "--run-id", "unseen-00", env={"RAY_TMPDIR": ray_tmp})
    finally:
        os.killpg(node.pid, signal.SIGTERM)
        node.wait(timeout=60)
        cluster.shutdown()
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert res.returncode != 0
    err = " ".join(res.stderr.split())
    assert "cannot see the run directory" in err and "runs_dir" in err, res.stderr
    assert "bug in roll" not in err and "Traceback" not in res.stderr
    assert not (hidden / "unseen-00" / "checkpoints").exists()  # refused before any step


def _wait_for_cpus(address: str, ray_tmp: str, cpus: int, timeout: float = 120) -> None:
    """Until the cluster at `address` counts `cpus` CPUs (the hidden node has joined)."""
    code = (
        "import ray, sys, time\n"
        f"ray.init(address={address!r}, include_dashboard=False, log_to_driver=False)\n"
        f"end = time.time() + {timeout}\n"
        f"while ray.cluster_resources().get('CPU', 0) < {cpus} and time.time() < end:\n"
        "    time.sleep(0.5)\n"
        f"sys.exit(0 if ray.cluster_resources().get('CPU', 0) >= {cpus} else 1)\n"
    )
    env = {**os.environ, "RAY_TMPDIR": ray_tmp}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=timeout + 60)
