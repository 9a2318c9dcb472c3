"""The topology parsers (pure): Slurm's topology.conf with real host lists, CSV, JSON and Kubernetes node labels, on
files shaped like the ones operators keep (tests/fixtures/topology), and every mistake named by its line."""

from __future__ import annotations

from pathlib import Path

import pytest

from clusterdx import topology as t

FIX = Path(__file__).parent / "fixtures" / "topology"


def text(name: str) -> str:
    return (FIX / name).read_text()


@pytest.mark.parametrize(("expr", "hosts"), [
    ("gpu[001-003]", ["gpu001", "gpu002", "gpu003"]),
    ("gpu[008-010,099]", ["gpu008", "gpu009", "gpu010", "gpu099"]),
    ("a[1-2]-b[3-4]", ["a1-b3", "a1-b4", "a2-b3", "a2-b4"]),
    ("n1,n[3-4]", ["n1", "n3", "n4"]),
    ("single", ["single"]),
])
def test_it_expands_host_lists_keeping_zero_padding(expr: str, hosts: list[str]) -> None:
    assert t.expand_hostlist(expr) == hosts


def test_a_tree_topology_gives_each_node_its_leaf_and_the_spine_above_it() -> None:
    places = t.parse_slurm_topology(text("tree-topology.conf"))
    assert len(places) == 42
    assert places["gpu001"] == places["gpu016"] == {"switch": "leaf01", "spine": "spine1"}
    assert places["gpu017"] == {"switch": "leaf02", "spine": "spine1"}
    # Continued onto the next line with a backslash; a leaf under spine2, itself under a core switch.
    assert places["gpu-spare2"] == places["gpu040"] == {"switch": "leaf03", "spine": "spine2"}
    assert "gpu041" not in places


def test_a_block_topology_gives_each_node_its_block_as_the_rack() -> None:
    places = t.parse_slurm_topology(text("block-topology.conf"))
    assert places["gb200-01"] == places["gb200-18"] == {"rack": "nvl72-a"}
    assert places["gb200-19"] == {"rack": "nvl72-b"} and len(places) == 36


def test_csv_and_json_give_the_same_places() -> None:
    from_csv, from_json = t.parse_file(text("cluster.csv"), "cluster.csv"), t.parse_file(text("cluster.json"), "x")
    assert from_csv["node-000"] == from_json["node-000"] == {"rack": "rack-00", "switch": "leaf-00", "spine": "spine-0"}
    assert from_csv["node-009"] == from_json["node-009"] == {"rack": "rack-01", "switch": "leaf-01"}
    assert set(from_csv) == {"node-000", "node-001", "node-009"}
    # Without a header the columns are host,rack,switch,spine; a mapping keyed by host is JSON too.
    assert t.parse_csv("n1,r1,l1\n") == {"n1": {"rack": "r1", "switch": "l1"}}
    assert t.parse_json('{"n1": {"switch": "l1"}}') == {"n1": {"switch": "l1"}}
    assert t.parse_file(text("tree-topology.conf"), "upload")["gpu001"]["switch"] == "leaf01"  # by its content


@pytest.mark.parametrize(("content", "name", "reason"), [
    ("SwitchName=leaf1 Nodes=gpu[001-003\n", "topology.conf", "line 1: bad host list 'gpu[001-003': unbalanced"),
    ("SwitchName=l1 Nodes=n1\nSwitchName=l2 Nodes=n[1-2]\n", "t.conf", "node n1 is listed under two leaf switches"),
    ("SwitchName=l1 Nodes=n1\nNodeName=n1 Weight=1\n", "t.conf", "line 2: expected SwitchName=..., BlockName="),
    ("SwitchName=l1 Nodes\n", "t.conf", "line 1: expected Key=Value, got 'Nodes'"),
    ("SwitchName=s1 Switches=l[1-2]\n", "t.conf", "no switch or block in this topology.conf lists any node"),
    ("SwitchName=leaf/1 Nodes=n1\n", "t.conf", "line 1: switch: the string 'leaf/1' does not match"),
    ("SwitchName=l1 Nodes=n[0-999999]\n", "t.conf", "line 1: bad host list 'n[0-999999]': range too large"),
    ("SwitchName=l1 Nodes=n[0-60000],m[0-60000]\n", "t.conf", "line 1: host list 'n[0-60000],m[0-60000]' names 120002"),
    ("host,rack,row\nn1,r1,x\n", "t.csv", "line 1: unknown column 'row'"),
    ("host,rack\nn1,rack 1\n", "t.csv", "line 2: rack: the string 'rack 1' does not match"),
    ("n1,r1,l1,s1,extra\n", "t.csv", "line 1: 5 cells, expected at most 4"),
    ("n1,r1\nn1,r2\n", "t.csv", "line 2: n1 is listed twice"),
    ("n 1,r1\n", "t.csv", "line 1: not a host name: 'n 1'"),
    ("n1,,,\n", "t.csv", "line 1: n1 has no rack, switch or spine"),
    ("", "t.csv", "the file holds no rows"),
    ('[{"host": "n1", "rack": 7}]', "t.json", "nodes[0]: rack: expected a string, got 7"),
    ('[{"host": "n1", "row": "x"}]', "t.json", "nodes[0]: unknown key 'row'"),
    ('{"n1": {"switch": "' + "x" * 65 + '"}}', "t.json", "n1: switch: too long: 65 > 64"),
    ("[1,", "t.json", "not valid JSON"),
])
def test_a_mistake_is_named_by_where_it_is(content: str, name: str, reason: str) -> None:
    with pytest.raises(t.TopologyError) as info:
        t.parse_file(content, name)
    assert str(info.value).startswith(reason), str(info.value)


def test_node_labels_give_the_place_and_a_zone_is_never_a_rack() -> None:
    labels = t.parse_labels(text("node-labels"))
    assert labels["topology.kubernetes.io/zone"] == "us-east-1a"
    assert t.place_from_labels(labels) == {"rack": "r17", "switch": "leaf02", "spine": "spine1"}
    # Topograph's first releases called the leaf a block; its fabric tiers are read too.
    assert t.place_from_labels({"network.topology.nvidia.com/block": "s1", "fabric.topograph.run/tier-1": "s2"}) == {
        "switch": "s1", "spine": "s2"}
    assert t.place_from_labels({"topology.kubernetes.io/zone": "z"}) == {}
    assert t.parse_labels('a="quoted \\"x\\""\n\n') == {"a": 'quoted "x"'}
    with pytest.raises(t.TopologyError, match="line 1: expected key=\"value\""):
        t.parse_labels("no-equals-sign\n")
