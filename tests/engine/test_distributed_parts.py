"""The pure parts of distributed serving: the layer split, the host file, the wire header,
the fingerprint comparison."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys

import pytest
from mlx._distributed_utils import launch as mlx_launch
from mlx._distributed_utils.common import Hostfile

from mtplxd.engine.distributed.fingerprint import differences, fingerprint
from mtplxd.engine.distributed.hostfile import parse_hosts, read_hosts, ring_addresses
from mtplxd.engine.distributed.tensor import tensor_refusal
from mtplxd.engine.distributed.launcher import SSH, WORKER_MODULE, Workers
from mtplxd.engine.distributed.split import parse_split, split_layers
from mtplxd.engine.distributed.wire import FORWARD, MAX_TRIMS, Header


def test_layers_split_in_proportion_to_memory_contiguous_and_complete():
    assert split_layers(48, [64, 32]) == [(0, 32), (32, 48)]
    assert split_layers(64, [1, 1, 1]) == [(0, 22), (22, 43), (43, 64)]
    assert split_layers(3, [1000, 1, 1]) == [(0, 1), (1, 2), (2, 3)]  # every rank holds one
    assert split_layers(4, [0, 0]) == [(0, 2), (2, 4)]  # memory unknown: even


def test_more_ranks_than_layers_is_refused():
    with pytest.raises(ValueError, match="3 ranks but only 2 layers"):
        split_layers(2, [1, 1, 1])


def test_a_given_split_must_cover_every_layer():
    assert parse_split("2,1,1", 4) == [(0, 2), (2, 3), (3, 4)]
    with pytest.raises(ValueError, match="sum to 4 layers"):
        parse_split("2,1", 4)
    with pytest.raises(ValueError, match="layer counts"):
        parse_split("half,half", 4)


def test_host_file_in_mlx_launch_format_gives_the_ring_addresses():
    hosts = parse_hosts({"backend": "ring", "hosts": [
        {"ssh": "mac-a.local", "ips": ["10.0.0.1"], "model": "/models/q"},
        {"ssh": "mac-b.local", "ips": ["10.0.0.2"]}]})
    assert hosts.size == 2 and hosts.hosts[0].model == "/models/q"
    assert not hosts.hosts[1].is_local
    assert json.loads(ring_addresses(hosts, 5000)) == [["10.0.0.1:5000"], ["10.0.0.2:5001"]]


def _what_mlx_launch_starts(hostfile_path, monkeypatch, port: int) -> list[tuple]:
    """The (rank, host, python, cwd, files, env, command) of each rank that mlx.launch's own
    ring launcher would start for this host file (its process starting replaced by a note)."""
    started = []
    monkeypatch.setattr(mlx_launch, "_launch_with_io",
                        lambda cls, ranks, verbose: started.extend(args for args, _ in ranks))
    args = argparse.Namespace(starting_port=port, connections_per_ip=1, env=[], verbose=False,
                              cwd=None, python=None)
    mlx_launch.launch_ring(argparse.ArgumentParser(), Hostfile.from_file(hostfile_path).hosts,
                           args, ["prog"])
    return started


def test_an_ssh_worker_gets_the_ring_file_and_environment_mlx_launch_gives_it(tmp_path, monkeypatch):
    # A stand-in interpreter on the "remote" host: it prints what the worker would see.
    fake_python = tmp_path / "python"
    fake_python.write_text('#!/bin/sh\necho "rank=$MLX_RANK"\necho "ring=$(cat "$MLX_HOSTFILE")"\n'
                           'echo "synch=$MLX_METAL_FAST_SYNCH"\necho "args=$*"\n')
    fake_python.chmod(0o755)
    path = tmp_path / "hosts.json"
    path.write_text(json.dumps({"backend": "ring", "envs": ["MLX_METAL_FAST_SYNCH=1"], "hosts": [
        {"ssh": "mac-a.local", "ips": ["10.0.5.1", "10.0.6.1"]},
        {"ssh": "mac-b.local", "ips": ["10.0.5.2", "10.0.6.2"], "model": "/models/b",
         "python": str(fake_python)},
        {"ssh": "mac-c.local", "ips": ["10.0.5.3", "10.0.6.3"], "python": str(fake_python)}]}))
    reference = _what_mlx_launch_starts(path, monkeypatch, 5000)
    workers = Workers(read_hosts(path), "/models/a", 5000, tmp_path / "logs", timeout=7)
    ring = reference[1][4]["MLX_HOSTFILE"]
    assert workers.ring == ring  # the very file mlx.launch writes, both IPs of every host
    assert json.loads(ring)[2] == ["10.0.5.3:5004", "10.0.6.3:5005"]
    for rank, host in ((1, "mac-b.local"), (2, "mac-c.local")):
        argv = workers.launch_argv(rank, workers.hosts.hosts[rank])
        assert argv[:-1] == [*SSH, host] and "-tt" in SSH  # mlx.launch's forced terminal
        # What the remote login shell runs, run here by bash.
        shown = subprocess.run(["bash", "-c", argv[-1]], capture_output=True, text=True,
                               timeout=30, cwd=tmp_path).stdout.splitlines()
        model = "/models/b" if rank == 1 else "/models/a"
        assert shown[1:] == [f"rank={rank}", f"ring={ring}", "synch=1",
                             f"args=-m {WORKER_MODULE} --model {model} --timeout 7"]


def test_hosts_with_different_numbers_of_ips_are_refused():
    with pytest.raises(ValueError, match='same number of "ips"'):
        parse_hosts({"hosts": [{"ssh": "a", "ips": ["10.0.0.1", "10.0.1.1"]},
                               {"ssh": "b", "ips": ["10.0.0.2"]}]})


@pytest.mark.parametrize(("data", "says"), [
    ({"hosts": [{"ssh": "127.0.0.1"}]}, "at least two hosts"),
    ({"hosts": [{"ssh": "mac-a.local"}, {"ssh": "mac-b.local"}]}, 'needs "ips"'),
    ({"backend": "mpi", "hosts": []}, "not supported yet"),
    ({"hosts": "a,b"}, "hosts.json must be"),
    ({"hosts": [{"ips": ["10.0.0.1"]}]}, 'needs an "ssh" name'),
    ({"parallel": "expert", "hosts": [{"ssh": "10.0.0.1"}, {"ssh": "10.0.0.2"}]},
     '"parallel" must be "pipeline" or "tensor"'),
])
def test_a_bad_host_file_says_what_is_wrong(data, says):
    with pytest.raises(ValueError, match=says):
        parse_hosts(data)


def test_the_host_file_chooses_pipeline_or_tensor_parallel():
    two = [{"ssh": "10.0.0.1"}, {"ssh": "10.0.0.2"}]
    assert parse_hosts({"hosts": two}).parallel == "pipeline"
    assert parse_hosts({"parallel": "tensor", "hosts": two}).parallel == "tensor"


def test_tensor_parallel_refuses_heads_that_do_not_divide_across_the_ranks():
    config = {"num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128}
    assert tensor_refusal("qwen3", config, 2) is None
    assert "num_attention_heads (4) across the ranks" in tensor_refusal("qwen3", config, 3)
    assert "only, not qwen3_next" in tensor_refusal("qwen3_next", config, 2)
    # The hybrid also splits its Gated DeltaNet heads, nested under text_config.
    hybrid = {"text_config": {**config, "linear_num_key_heads": 3, "linear_num_value_heads": 6}}
    assert "linear_num_key_heads (3) across the ranks" in tensor_refusal("qwen3_5", hybrid, 2)


def test_header_round_trips_trims_and_frees():
    header = Header(FORWARD, row=7, tokens=4, trims=[3, 1], frees=[2, 5])
    assert Header.decode(header.encode()) == header
    with pytest.raises(ValueError):
        Header(FORWARD, trims=[1] * (MAX_TRIMS + 1)).encode()


def test_fingerprints_match_for_a_copy_and_name_a_changed_config_key(tiny_model_factory, tmp_path):
    source = tiny_model_factory("qwen3")
    copy = tmp_path / "copy"
    shutil.copytree(source, copy)
    assert differences(fingerprint(source), fingerprint(copy)) == []
    config = json.loads((copy / "config.json").read_text())
    config["rope_theta"] = 1.0
    (copy / "config.json").write_text(json.dumps(config))
    (copy / "model.safetensors").unlink()
    found = differences(fingerprint(source), fingerprint(copy))
    assert any(d.startswith("config rope_theta: 1.0") for d in found)
    assert "file model.safetensors is missing" in found


def test_a_worker_never_loads_the_fan_code():
    # Only the daemon (rank 0) drives fans, so no lost or frozen group can leave them manual.
    shown = subprocess.run(
        [sys.executable, "-c", "import sys, mtplxd.engine.distributed.worker; "
         "print([m for m in sys.modules if m.startswith('mtplxd.fans')])"],
        capture_output=True, text=True, timeout=120)
    assert shown.stdout.strip() == "[]", shown.stderr


def test_the_pipeline_trunk_inherits_forward_and_overrides_only_the_body():
    # Trunk.forward's arguments (images' input embeddings, say) reach a group unchanged: the
    # pipeline replaces the layers' body, never the forward's signature or embedding step.
    import inspect

    from mtplxd.engine.distributed.pipeline import PipelineTrunk
    from mtplxd.engine.model.trunk import Trunk

    assert PipelineTrunk.forward is Trunk.forward
    assert PipelineTrunk.input_hidden is Trunk.input_hidden
    assert inspect.signature(PipelineTrunk.body) == inspect.signature(Trunk.body)
