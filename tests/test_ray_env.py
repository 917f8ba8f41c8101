"""The checks tests/conftest.py runs after every test so that one test's Ray cannot break the next one's.

No Ray is started: the sequence that broke test_recipe_e2e.py is replayed on Ray's config cache alone.
There, a first local ``ray.init()`` (test_cpu_backend.py) had set ``RAY_AUTH_MODE=token``; then
test_multinode.py set it to ``disabled`` with monkeypatch, ``ray.init(address=...)`` re-read Ray's
config (cache: disabled), and monkeypatch put ``token`` back in the variable only. Every later local
``ray.init()`` failed to start its GCS ("Missing authorization header" in gcs_server.out).
"""

from __future__ import annotations

import os

import pytest

raylet = pytest.importorskip("ray._raylet")

from recipe_helpers.ray_env import (  # noqa: E402
    ray_auth_mode,
    ray_auth_out_of_sync,
    ray_env_changes,
)


def cached_mode() -> str:
    return "token" if raylet.get_authentication_mode() == raylet.AuthenticationMode.TOKEN else "disabled"


def test_a_variable_restored_over_a_stale_cache_is_caught():
    with ray_auth_mode("token"):  # as after the first local ray.init()
        assert cached_mode() == "token" and ray_auth_out_of_sync() is None
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("RAY_AUTH_MODE", "disabled")
            raylet.Config.initialize("")  # what ray.init(address=...) does with the variable of the moment
            assert cached_mode() == "disabled" and ray_auth_out_of_sync() is None
        # monkeypatch restored the variable, not the cache
        assert os.environ["RAY_AUTH_MODE"] == "token" and cached_mode() == "disabled"
        problem = ray_auth_out_of_sync()
        assert problem and "RAY_AUTH_MODE=token" in problem and "'disabled'" in problem, problem


def test_ray_auth_mode_restores_the_variable_and_the_cache():
    with ray_auth_mode("token"):
        with ray_auth_mode("disabled"):
            assert os.environ["RAY_AUTH_MODE"] == "disabled" and cached_mode() == "disabled"
        assert os.environ["RAY_AUTH_MODE"] == "token" and cached_mode() == "token"
        assert ray_auth_out_of_sync() is None


def test_only_rays_own_change_of_the_environment_is_allowed():
    assert ray_env_changes({}, {"RAY_AUTH_MODE": "token"}) == {}  # ray.init()'s own, for the process
    assert ray_env_changes({}, {"RAY_AUTH_MODE": "disabled"}) == {"RAY_AUTH_MODE": (None, "disabled")}
    assert ray_env_changes({"RAY_AUTH_MODE": "token"}, {}) == {"RAY_AUTH_MODE": ("token", None)}
    assert ray_env_changes({}, {"RAY_ADDRESS": "127.0.0.1:1"}) == {"RAY_ADDRESS": (None, "127.0.0.1:1")}
    assert ray_env_changes({"RAY_X": "1"}, {"RAY_X": "1"}) == {}
