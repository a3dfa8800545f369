"""Config layering (defaults < file < FUSION_* < flags), error naming, --check-config."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from fusiond.cli import EX_CONFIG, build_parser
from fusiond.cli import run as fusiond_run
from fusiond.config import DaemonConfig, get, keys, load_config
from fusiond.errors import ConfigError


def _flags(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def test_defaults_are_valid() -> None:
    loaded = load_config(path=None, env={}, flags=None)
    assert loaded.config == DaemonConfig()
    assert loaded.origin == {}


def test_every_key_has_an_env_and_a_flag_twin() -> None:
    parser = build_parser()
    flags = {a for action in parser._actions for a in action.option_strings}
    for k in keys():
        assert k.flag in flags, k.path
        assert k.env == "FUSION_" + k.path.replace(".", "_").upper()
    # every timeout is configurable, by construction of the config sections
    assert any(k.path == "cluster.dead_after_s" for k in keys())


def test_layers_override_in_order(tmp_path: Path) -> None:
    f = tmp_path / "f.toml"
    f.write_text('log_level = "warning"\n[net]\nlisten = "127.0.0.1:1000"\n'
                 'connect_timeout_s = 3\n[cluster]\nbootstrap = ["10.0.0.1:7420"]\n')
    env = {"FUSION_NET_LISTEN": "127.0.0.1:2000", "FUSION_CLUSTER_MDNS": "off"}
    loaded = load_config(path=f, env=env, flags=_flags("--net-listen", "127.0.0.1:3000",
                                                       "--cluster-bootstrap", "a:1,b:2",
                                                       "--cluster-bootstrap", "c:3"))
    c = loaded.config
    assert c.log_level == "warning" and loaded.origin["log_level"] == f"{f}:1"
    assert c.net.connect_timeout_s == 3.0 and isinstance(c.net.connect_timeout_s, float)
    assert c.net.listen == "127.0.0.1:3000" and loaded.origin["net.listen"] == "flag --net-listen"
    assert c.cluster.mdns is False
    assert loaded.origin["cluster.mdns"] == "environment FUSION_CLUSTER_MDNS"
    assert c.cluster.bootstrap == ["a:1", "b:2", "c:3"]
    # untouched keys keep their defaults
    assert c.api.socket == DaemonConfig().api.socket


def test_env_beats_file(tmp_path: Path) -> None:
    f = tmp_path / "f.toml"
    f.write_text("[cluster]\ngossip_interval_s = 2.0\n")
    loaded = load_config(path=f, env={"FUSION_CLUSTER_GOSSIP_INTERVAL_S": "0.5"})
    assert loaded.config.cluster.gossip_interval_s == 0.5


def test_bad_file_value_names_key_and_line(tmp_path: Path) -> None:
    f = tmp_path / "f.toml"
    f.write_text('# comment\n\n[cluster]\nmdns = true\nsuspect_after_s = "soon"\n')
    with pytest.raises(ConfigError) as e:
        load_config(path=f, env={})
    msg = str(e.value)
    assert "cluster.suspect_after_s" in msg and f"{f}:5" in msg and "soon" in msg


def test_unknown_file_key_is_an_error(tmp_path: Path) -> None:
    f = tmp_path / "f.toml"
    f.write_text("[net]\nlisten = \"127.0.0.1:0\"\nlistne = \"x\"\n")
    with pytest.raises(ConfigError, match=r"f\.toml:3: unknown key 'net\.listne'"):
        load_config(path=f, env={})


def test_bad_env_value_names_the_variable() -> None:
    with pytest.raises(ConfigError, match="environment FUSION_NET_CONNECT_TIMEOUT_S"):
        load_config(env={"FUSION_NET_CONNECT_TIMEOUT_S": "fast"})
    with pytest.raises(ConfigError, match="environment FUSION_CLUSTER_MDNS"):
        load_config(env={"FUSION_CLUSTER_MDNS": "maybe"})


def test_bad_flag_value_names_the_flag() -> None:
    with pytest.raises(ConfigError, match="flag --cluster-dead-after-s"):
        load_config(env={}, flags=_flags("--cluster-dead-after-s", "-1"))
    with pytest.raises(ConfigError, match=r"flag --log-level.*debug, info"):
        load_config(env={}, flags=_flags("--log-level", "loud"))


def test_semantic_checks() -> None:
    with pytest.raises(ConfigError, match=r"api\.tcp.*loopback"):
        load_config(env={"FUSION_API_TCP": "0.0.0.0:9000"})
    with pytest.raises(ConfigError, match=r"dead_after_s = 4\.0 from environment FUSION_CLUSTER_"
                       r"DEAD_AFTER_S: must be larger than cluster\.suspect_after_s"):
        load_config(env={"FUSION_CLUSTER_SUSPECT_AFTER_S": "5",
                         "FUSION_CLUSTER_DEAD_AFTER_S": "4"})
    with pytest.raises(ConfigError, match=r"net\.listen.*loopback"):
        load_config(env={"FUSION_NET_INSECURE_PLAINTEXT": "1"})  # default listen is 0.0.0.0
    with pytest.raises(ConfigError, match=r"cluster\.bootstrap.*entry 1"):
        load_config(env={"FUSION_CLUSTER_BOOTSTRAP": "a:1,b:99999"})
    ok = load_config(env={"FUSION_NET_INSECURE_PLAINTEXT": "1",
                          "FUSION_NET_LISTEN": "127.0.0.1:0"})
    assert get(ok.config, "net.insecure_plaintext") is True


def test_unknown_env_var_warns() -> None:
    loaded = load_config(env={"FUSION_NET_LISTNE": "x", "FUSION_CONFIG": ""})
    assert loaded.warnings == ["ignoring unknown environment variable FUSION_NET_LISTNE"]


def test_missing_named_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(path=tmp_path / "nope.toml", env={})


def test_check_config_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    for k in [k for k in __import__("os").environ if k.startswith("FUSION_")]:
        monkeypatch.delenv(k)
    good = tmp_path / "good.toml"
    good.write_text('[net]\nlisten = "127.0.0.1:0"\n')
    assert fusiond_run(["--config", str(good), "--check-config"]) == 0
    out = capsys.readouterr()
    assert f"net.listen = '127.0.0.1:0'  # {good}:2" in out.out
    bad = tmp_path / "bad.toml"
    bad.write_text('loop = "tokio"\n')
    assert fusiond_run(["--config", str(bad), "--check-config"]) == EX_CONFIG == 78
    err = capsys.readouterr().err
    assert "loop = 'tokio'" in err and f"{bad}:1" in err
    # a bad config also stops a real start with 78, before anything is bound
    assert fusiond_run(["--config", str(bad)]) == 78
    monkeypatch.setenv("FUSION_CHECK_CONFIG", "1")
    monkeypatch.setenv("FUSION_LOG_LEVEL", "chatty")
    assert fusiond_run([]) == 78
    assert "environment FUSION_LOG_LEVEL" in capsys.readouterr().err


def test_every_cluster_and_net_knob_is_configurable() -> None:
    import dataclasses

    from fusiond.cluster import ClusterConfig
    from fusiond.config import ClusterSection, NetSection
    from fusiond.daemon import (
        CLUSTER_CONFIG_NOT_CONFIGURABLE,
        NET_CONFIG_NOT_CONFIGURABLE,
        _cluster_config,
        _net_config,
    )
    from fusiond.net import NetConfig

    ours = {f.name for f in dataclasses.fields(ClusterSection)}
    theirs = {f.name for f in dataclasses.fields(ClusterConfig)} - CLUSTER_CONFIG_NOT_CONFIGURABLE
    assert theirs <= ours, f"[cluster] lacks {sorted(theirs - ours)}"
    # the mapping carries values through (not just names)
    cfg = DaemonConfig()
    cfg.cluster.dead_after_s = 42.0
    cfg.cluster.bootstrap = ["10.1.2.3"]
    cc = _cluster_config(ClusterConfig, cfg, cfg.cluster.bootstrap)
    assert cc.dead_after_s == 42.0 and cc.bootstrap == (("10.1.2.3", 7420),)
    ours = {f.name for f in dataclasses.fields(NetSection)}
    theirs = {f.name for f in dataclasses.fields(NetConfig)} - NET_CONFIG_NOT_CONFIGURABLE
    assert theirs <= ours, f"[net] lacks {sorted(theirs - ours)}"
    cfg.net.backoff_max_s = 7.0
    cfg.net.payload_check = "on"
    nc = _net_config(NetConfig, cfg)
    assert nc.backoff_max_s == 7.0 and nc.payload_check is True


def test_the_daemon_and_the_services_share_one_set_of_defaults() -> None:
    """A daemon started without a config file runs the transport and the cluster service on
    exactly the settings `NetConfig()` and `ClusterConfig()` give in code (their defaults come
    from fusiond.defaults): they once differed (connect timeout 5 vs 10 s, gossip interval 1.0
    vs 0.5 s, election timeout 3 vs 1 s), so what tests measured was not what ran."""
    from fusiond.cluster import ClusterConfig
    from fusiond.daemon import _cluster_config, _net_config
    from fusiond.net import NetConfig

    cfg = DaemonConfig()
    assert _net_config(NetConfig, cfg) == NetConfig()
    assert _cluster_config(ClusterConfig, cfg, cfg.cluster.bootstrap) == ClusterConfig()
