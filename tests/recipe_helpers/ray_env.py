"""Keeping Ray's process-wide state from leaking between tests that each start a Ray of their own.

Ray 2.60 reads its authentication mode from ``RAY_AUTH_MODE`` but caches it in the C++ ``RayConfig``
of the process, which is re-read only at some points: a local ``ray.init()`` re-reads it only when
``RAY_AUTH_MODE`` is unset (it then sets ``RAY_AUTH_MODE=token`` in ``os.environ`` itself, for the
rest of the process), and connecting to a cluster re-reads it from the environment of the moment.
A test that changes ``RAY_AUTH_MODE`` and puts it back with ``monkeypatch`` restores the variable but
not the cache; the next local ``ray.init()`` then starts a GCS that requires a token (the variable)
from a driver that sends none (the cache): "Failed to start GCS", ``Missing authorization header``
in gcs_server.out. :func:`ray_auth_mode` changes both and restores both; :func:`ray_auth_out_of_sync`
and :func:`ray_env_changes` are what ``tests/conftest.py`` checks after every test.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

AUTH_MODE = "RAY_AUTH_MODE"
# What Ray itself leaves in os.environ: the first local ray.init() with RAY_AUTH_MODE unset sets it
# to "token" (ray._private.authentication.authentication_token_setup.enable_token_auth_by_default).
# Importing ray sets RAY_CLIENT_MODE=0, importing verl RAY_ENABLE_UV_RUN_RUNTIME_ENV=0 (verl/__init__.py's
# setdefault): import-time changes a test that first imports them leaves behind, harmless to ray.init.
RAY_OWN_CHANGES = {
    AUTH_MODE: (None, "token"),
    "RAY_CLIENT_MODE": (None, "0"),
    "RAY_ENABLE_UV_RUN_RUNTIME_ENV": (None, "0"),
}


def ray_environ() -> dict[str, str]:
    """The ``RAY_*`` variables of this process."""
    return {k: v for k, v in os.environ.items() if k.startswith("RAY_")}


def ray_env_changes(before: Mapping[str, str], after: Mapping[str, str]) -> dict[str, tuple]:
    """``RAY_*`` variables that differ between the two snapshots, name -> (before, after), without the
    change Ray makes itself (:data:`RAY_OWN_CHANGES`)."""
    changed = {k: (before.get(k), after.get(k)) for k in set(before) | set(after) if before.get(k) != after.get(k)}
    return {k: v for k, v in changed.items() if RAY_OWN_CHANGES.get(k) != v}


def ray_auth_out_of_sync() -> str | None:
    """Why the next local ``ray.init()`` of this process would fail to start its GCS, or None.

    It would when ``RAY_AUTH_MODE`` is set (so ray.init does not re-read it) to a mode other than the
    one Ray's config cache holds. Nothing to check where Ray's extension was never imported."""
    raylet = sys.modules.get("ray._raylet")
    env = os.environ.get(AUTH_MODE)
    if raylet is None or env is None:
        return None
    cached = "token" if raylet.get_authentication_mode() == raylet.AuthenticationMode.TOKEN else "disabled"
    wanted = "token" if env.strip().lower() == "token" else "disabled"
    if cached == wanted:
        return None
    return (
        f"{AUTH_MODE}={env} in os.environ but Ray's cached config of this process says {cached!r}: the next "
        f"ray.init() would start a GCS in {wanted!r} mode that this driver cannot talk to (InvalidAuthToken). "
        "Change the mode with tests/recipe_helpers/ray_env.ray_auth_mode, not monkeypatch.setenv"
    )


def _reload_ray_config() -> None:
    """Make Ray's cached config and token follow os.environ again (as Ray's own test utilities do:
    ``ray._private.authentication_test_utils.reset_auth_token_state``: config first, then the token)."""
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


@contextmanager
def ray_auth_mode(mode: str) -> Iterator[None]:
    """``RAY_AUTH_MODE=mode`` in this process for the block, Ray's cached config following it; on exit
    Ray is shut down and both the variable and the cache are back to what they were."""
    import ray

    if ray.is_initialized():
        raise RuntimeError("ray_auth_mode: shut Ray down before changing its authentication mode")
    saved = os.environ.get(AUTH_MODE)
    os.environ[AUTH_MODE] = mode
    _reload_ray_config()
    try:
        yield
    finally:
        if ray.is_initialized():
            ray.shutdown()
        if saved is None:
            os.environ.pop(AUTH_MODE, None)
        else:
            os.environ[AUTH_MODE] = saved
        _reload_ray_config()
