"""The pure parts of distributed serving: the layer split, the host file, the wire header,
the fingerprint comparison."""

from __future__ import annotations

import json
import shutil

import pytest

from mtplxd.engine.distributed.fingerprint import differences, fingerprint
from mtplxd.engine.distributed.hostfile import parse_hosts, ring_addresses
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


@pytest.mark.parametrize(("data", "says"), [
    ({"hosts": [{"ssh": "127.0.0.1"}]}, "at least two hosts"),
    ({"hosts": [{"ssh": "mac-a.local"}, {"ssh": "mac-b.local"}]}, 'needs "ips"'),
    ({"backend": "mpi", "hosts": []}, "not supported yet"),
    ({"hosts": "a,b"}, "hosts.json must be"),
    ({"hosts": [{"ips": ["10.0.0.1"]}]}, 'needs an "ssh" name'),
])
def test_a_bad_host_file_says_what_is_wrong(data, says):
    with pytest.raises(ValueError, match=says):
        parse_hosts(data)


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
