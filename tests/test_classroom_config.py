"""What ``classroom/jupyterhub_config.py`` sets, loaded as JupyterHub loads it (traitlets), without starting a hub:
loopback unless told otherwise, a network address only with a shared password, and a clear refusal of bad values.
The hub itself runs in tests/test_classroom_hub.py."""

from __future__ import annotations

import pytest
from traitlets.config.loader import PyFileConfigLoader

from tests.classroom import CONFIG, LOOPBACK


def load(monkeypatch: pytest.MonkeyPatch, tmp_path, **env: str):
    monkeypatch.setenv("KVLAB_HUB_STATE", str(tmp_path / "state"))
    for name in ("KVLAB_HUB_IP", "KVLAB_HUB_PORT", "KVLAB_HUB_PASSWORD", "KVLAB_EXCHANGE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return PyFileConfigLoader(CONFIG.name, path=str(CONFIG.parent)).load_config()


def test_every_listener_is_loopback_by_default(monkeypatch, tmp_path) -> None:
    c = load(monkeypatch, tmp_path)
    assert (c.JupyterHub.ip, c.JupyterHub.hub_ip, c.Spawner.ip) == (LOOPBACK,) * 3
    assert c.ConfigurableHTTPProxy.api_url.startswith(f"http://{LOOPBACK}:")
    assert c.JupyterHub.authenticator_class == "dummy"
    env = c.Spawner.environment
    assert env["KVLAB_EXCHANGE"] == str(tmp_path / "state" / "exchange") and env["KVLAB_COURSE_ID"] == "kvlab"
    assert str(tmp_path / "state") in c.JupyterHub.db_url and (tmp_path / "state").is_dir()


def test_a_network_address_needs_a_shared_password(monkeypatch, tmp_path) -> None:
    with pytest.raises(SystemExit, match="KVLAB_HUB_PASSWORD"):
        load(monkeypatch, tmp_path, KVLAB_HUB_IP="0.0.0.0")
    c = load(monkeypatch, tmp_path, KVLAB_HUB_IP="0.0.0.0", KVLAB_HUB_PASSWORD="eight chars")
    assert c.JupyterHub.ip == "0.0.0.0" and c.JupyterHub.authenticator_class == "shared-password"
    assert c.SharedPasswordAuthenticator.user_password == "eight chars"
    assert (c.JupyterHub.hub_ip, c.Spawner.ip) == (LOOPBACK, LOOPBACK)  # only the login page opens


@pytest.mark.parametrize("name, value", [("KVLAB_HUB_IP", "localhost:80"), ("KVLAB_HUB_PORT", "80000")])
def test_a_bad_value_is_refused_by_name(monkeypatch, tmp_path, name: str, value: str) -> None:
    with pytest.raises(SystemExit, match=name):
        load(monkeypatch, tmp_path, **{name: value})
