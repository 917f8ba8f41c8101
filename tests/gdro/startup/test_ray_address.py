"""The Ray address a launch joins, read and probed before Ray starts (recipe/gdro/startup/ray_address.py):
garbage is refused by name, a port where nothing listens and a server that is no Ray GCS (an HTTP server) are
refused within the probe's few seconds, and a dry run reports what the probe found instead of refusing.
(Launch-level: tests/gdro/test_cluster_faults.py.)"""

from __future__ import annotations

import http.server
import socket
import threading
import time

import pytest
from omegaconf import OmegaConf

from recipe.gdro.startup.checks import GDRORecipeError
from recipe.gdro.startup.ray_address import check_ray_address, parse_ray_address, resolve_ray_address


def _config(address=None):
    return OmegaConf.create({"ray_kwargs": {"ray_init": {"address": address}}})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("value", ["garbage", "host:", ":6379", "10.0.0.1:99999", "http://10.0.0.1:6379", "a b:1"])
def test_an_address_that_does_not_parse_is_one_line_naming_where_it_came_from(value):
    with pytest.raises(GDRORecipeError) as e:
        check_ray_address(_config(), environ={"RAY_ADDRESS": value})
    text = str(e.value)
    assert text.startswith(f"RAY_ADDRESS={value!r} is not a Ray address") and "\n" not in text
    with pytest.raises(GDRORecipeError, match="ray_kwargs.ray_init.address="):
        check_ray_address(_config(value), environ={})


def test_the_forms_ray_takes_parse():
    assert parse_ray_address("10.0.0.1:6379", "x") == ("10.0.0.1", 6379)
    assert parse_ray_address("[::1]:6379", "x") == ("::1", 6379)
    assert parse_ray_address("ray://head", "x") == ("head", 10001)
    # the config's address wins over RAY_ADDRESS (ray.init reads the variable only without one, or for auto)
    assert resolve_ray_address(_config("10.0.0.2:1"), environ={"RAY_ADDRESS": "10.0.0.3:1"}).host == "10.0.0.2"
    assert resolve_ray_address(_config("local"), environ={"RAY_ADDRESS": "10.0.0.3:1"}).joins is False


def test_nothing_listening_is_refused_in_seconds_and_a_dry_run_reports_it():
    port = _free_port()
    t0 = time.monotonic()
    with pytest.raises(GDRORecipeError) as e:
        check_ray_address(_config(), environ={"RAY_ADDRESS": f"127.0.0.1:{port}"})
    assert time.monotonic() - t0 < 10
    assert str(e.value).startswith(f"RAY_ADDRESS=127.0.0.1:{port}: no Ray GCS answers at 127.0.0.1:{port}")
    assert "run_scripts/ray_node.sh head" in str(e.value)
    dry = check_ray_address(_config(), environ={"RAY_ADDRESS": f"127.0.0.1:{port}"}, dry_run=True)
    assert dry.line().startswith(f"ray          joins 127.0.0.1:{port} (RAY_ADDRESS): no Ray GCS answers")
    assert dry.line().endswith("a launch now is refused")


def test_a_server_that_is_no_ray_gcs_is_refused():
    """A TCP connect succeeds on any listening port (and, behind some proxies, on every address): the probe asks
    the GCS a question, which an HTTP server does not answer."""
    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = server.server_address[1]
        with pytest.raises(GDRORecipeError) as e:
            check_ray_address(_config(f"127.0.0.1:{port}"), environ={}, timeout=3)
        assert f"ray_kwargs.ray_init.address=127.0.0.1:{port}:" in str(e.value)
        assert "no Ray GCS" in str(e.value)
    finally:
        server.shutdown()
