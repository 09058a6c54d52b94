from llmgw_agent.discovery import topo


def test_h100_eight_nics(fixture_text):
    t = topo.parse_topo(fixture_text("topo/h100-8gpu-8nic.txt"))
    assert sorted(t) == list(range(8))
    assert (t[0].numa_node, t[0].cpu_affinity) == (0, "0-47,96-143")
    assert t[4].numa_node == 1
    assert t[0].nvlink_peers == [1, 2, 3, 4, 5, 6, 7]
    assert t[0].nic_paths["mlx5_0"] == "PIX" and t[0].nic_paths["mlx5_7"] == "SYS"
    assert topo.nearest_nics(t[0].nic_paths) == ["mlx5_0", "mlx5_1"]
    assert topo.nearest_nics(t[1].nic_paths) == ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"]
    assert topo.nearest_nics(t[6].nic_paths) == ["mlx5_6", "mlx5_7"]


def test_old_layout_names_adapters_in_columns(fixture_text):
    t = topo.parse_topo(fixture_text("topo/old-driver-mlx-columns.txt"))
    assert t[0].nic_paths == {"mlx5_0": "PXB"} and t[1].nic_paths == {"mlx5_0": "SYS"}
    assert (t[1].nvlink_peers, t[1].numa_node) == ([0], 1)
