"""agent.yaml loaded from real files, with exactly the documented keys; wrong keys are named."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from llmgw_agent import __main__ as cli
from llmgw_agent.config import DEFAULT_STATE_DIR, Config, ConfigError, Fabric, load

EXAMPLE = Path(__file__).resolve().parents[2] / "deploy" / "agent.example.yaml"

FULL = """\
control_plane: https://cp.example.com/
join_token: tok-1
node_id: gpu-b07
labels:
  rack: b07
  nvl: true
model_dirs: [/models, /mnt/filer/models]
state_dir: /srv/llmgw-agent
heartbeat_interval: 2.5
mgmt_interface: bond0
fabrics:
  - name: ib-a
    hcas: [mlx5_0, mlx5_1]
    rate_gbps: 400
  - name: roce-b
    hcas: [mlx5_4]
    rate_gbps: 200
root: /srv/fixture
"""


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "agent.yaml"
    p.write_text(text)
    return p


def test_every_documented_key_from_a_file(tmp_path):
    cfg = load(_write(tmp_path, FULL))
    assert cfg == Config(
        control_plane="https://cp.example.com",
        join_token="tok-1",
        node_id="gpu-b07",
        labels={"rack": "b07", "nvl": "true"},
        model_dirs=("/models", "/mnt/filer/models"),
        state_dir="/srv/llmgw-agent",
        heartbeat_interval=2.5,
        mgmt_interface="bond0",
        fabrics=(Fabric("ib-a", ("mlx5_0", "mlx5_1"), 400), Fabric("roce-b", ("mlx5_4",), 200)),
        root="/srv/fixture",
        source=str(tmp_path / "agent.yaml"),
    )
    assert "tok-1" not in repr(cfg)


def test_the_shipped_example_loads(tmp_path):
    cfg = load(EXAMPLE)
    assert cfg.control_plane == "https://llmgw.example.com"
    assert cfg.join_token_file == "/etc/llmgw/join-token"
    assert cfg.fabrics == (
        Fabric("ib-compute", ("mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"), 400),
        Fabric("ib-storage", ("mlx5_4", "mlx5_5"), 200),
    )
    assert (cfg.node_id, cfg.mgmt_interface, cfg.heartbeat_interval) == ("gpu-a01", "eth0", 5.0)
    assert cfg.labels == {"rack": "a01", "zone": "dc1"}
    assert cfg.model_dirs == ("/models", "/mnt/shared/models")


def test_defaults(tmp_path):
    cfg = load(_write(tmp_path, "control_plane: http://127.0.0.1:8000\njoin_token: t\n"))
    assert cfg.node_id == socket.gethostname().split(".")[0]
    assert (cfg.state_dir, cfg.heartbeat_interval, cfg.fabrics, cfg.labels) == (DEFAULT_STATE_DIR, 5.0, (), {})


def test_join_token_file(tmp_path):
    (tmp_path / "tok").write_text("from-file\n")
    cfg = load(_write(tmp_path, f"control_plane: http://cp\njoin_token_file: {tmp_path / 'tok'}\n"))
    assert cfg.token() == "from-file"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "control_plane: http://cp\nheartbeat_intreval: 5\n",
            "unknown key 'heartbeat_intreval' (did you mean 'heartbeat_interval'?)",
        ),
        (
            "control_plane: http://cp\nfabrics:\n  - fabric: ib-a\n    hcas: [mlx5_0]\n",
            "unknown key fabrics[0].'fabric'",
        ),
        (
            "control_plane: http://cp\nfabrics:\n  - name: ib-a\n    hca: [mlx5_0]\n",
            "unknown key fabrics[0].'hca' (did you mean 'hcas'?)",
        ),
        (
            "control_plane: http://cp\nfabrics:\n  - name: ib-a\n    rate_gbs: 400\n",
            "unknown key fabrics[0].'rate_gbs' (did you mean 'rate_gbps'?)",
        ),
        (
            "control_plane: http://cp\nfabrics:\n  - name: ib-a\n    rate_gbps: fast\n",
            "fabrics[0].rate_gbps must be a whole number of Gb/s, not 'fast'",
        ),
        ("control_plane: http://cp\nfabrics:\n  - hcas: [mlx5_0]\n", "fabrics[0].name is required"),
        (
            "control_plane: http://cp\nfabrics:\n  - name: a\n    hcas: mlx5_0\n",
            "fabrics[0].hcas must be a list of non-empty strings",
        ),
        (
            "control_plane: http://cp\nfabrics:\n  - {name: a, hcas: [mlx5_0]}\n  - {name: b, hcas: [mlx5_0]}\n",
            "HCA 'mlx5_0' is declared on two fabrics",
        ),
        ("control_plane: http://cp\nheartbeat_interval: soon\n", "heartbeat_interval must be seconds"),
        ("control_plane: http://cp\nmodel_dirs: /models\n", "model_dirs must be a list of non-empty strings"),
        ("control_plane: http://cp\nlabels: [a]\n", "labels must be a mapping"),
        ("control_plane: http://cp\nnode_id: 7\n", "node_id must be a string, not int"),
        ("control_plane: cp.example.com\n", "control_plane must be an http(s) URL"),
        ("join_token: t\n", "control_plane is required"),
        (
            "control_plane: http://cp\njoin_token: a\njoin_token_file: /x\n",
            "give join_token or join_token_file, not both",
        ),
        ("- a\n", "must be a mapping"),
        ("control_plane: [\n", "not valid YAML"),
    ],
)
def test_errors_name_the_key_and_the_file(tmp_path, text, message):
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load(path)
    assert str(e.value).startswith(f"{path}: ")
    assert message in str(e.value)


def test_a_host_name_unfit_for_a_node_id_says_to_set_node_id(tmp_path, monkeypatch):
    monkeypatch.setattr("socket.gethostname", lambda: "gpu_node!.dc1")
    path = _write(tmp_path, "control_plane: http://cp\n")
    with pytest.raises(ConfigError) as e:
        load(path)
    assert str(e.value) == (
        f"{path}: node_id 'gpu_node!' (this host's name: node_id is not set; set it)"
        " must be letters, digits, '.', '_' or '-'"
    )


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load(tmp_path / "nope.yaml")


def test_cli_check_reports_bad_key_and_exit_code(tmp_path, capsys):
    path = _write(tmp_path, "control_plane: http://cp\nfabrics:\n  - nmae: x\n")
    assert cli.main(["--config", str(path), "--check"]) == 2
    assert f"llmgw-agent: {path}: unknown key fabrics[0].'nmae' (did you mean 'name'?)" in capsys.readouterr().err


def test_cli_check_hides_the_token(tmp_path, capsys):
    path = _write(tmp_path, FULL)
    assert cli.main(["--config", str(path), "--check", "--root", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "tok-1" not in out
    assert f"root: {tmp_path}" in out


def test_metrics_keys_load_and_a_bad_value_names_its_key(tmp_path, monkeypatch):
    from llmgw_agent.config import METRICS_TOKEN_ENV, parse

    monkeypatch.delenv(METRICS_TOKEN_ENV, raising=False)
    base = {"control_plane": "http://cp", "node_id": "n1"}
    path = tmp_path / "agent.yaml"
    path.write_text("control_plane: http://cp\nnode_id: n1\nmetrics_listen: ':9400'\nmetrics_token: s3cret\n")
    cfg = load(path)
    assert (cfg.metrics_listen, cfg.metrics_token, cfg.metrics_open) == (":9400", "s3cret", False)
    assert "s3cret" not in repr(cfg)
    assert parse(base).metrics_listen == ""
    with pytest.raises(ConfigError, match=r"metrics_listen '9400' is not host:port"):
        parse(base | {"metrics_listen": "9400", "metrics_open": True})
    with pytest.raises(ConfigError, match=r"metrics_listen needs metrics_token"):
        parse(base | {"metrics_listen": ":9400"})
    with pytest.raises(ConfigError, match=r"metrics_open must be true or false"):
        parse(base | {"metrics_listen": ":9400", "metrics_open": "yes"})
    assert parse(base | {"metrics_listen": ":9400", "metrics_open": True}).metrics_open is True
    monkeypatch.setenv(METRICS_TOKEN_ENV, "from-env")
    assert parse(base | {"metrics_listen": "10.0.0.5:9400"}).metrics_token == "from-env"


def test_cli_check_hides_the_metrics_token(tmp_path, capsys):
    path = tmp_path / "agent.yaml"
    path.write_text("control_plane: http://cp\nnode_id: n1\nmetrics_listen: ':9400'\nmetrics_token: scrape-s3cret\n")
    assert cli.main(["--config", str(path), "--check"]) == 0
    out = capsys.readouterr().out
    assert "scrape-s3cret" not in out
    assert "metrics_token: (set)" in out
    assert "metrics_listen: :9400" in out
