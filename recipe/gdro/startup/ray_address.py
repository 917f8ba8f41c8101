"""The Ray cluster a launch joins, read and probed before Ray starts.

``ray.init`` takes its address from ``ray_kwargs.ray_init.address``; when that is unset or ``auto``, from
``RAY_ADDRESS``; when that is unset too, from the cluster a ``ray start`` on this machine last recorded
(``<ray temp dir>/ray_current_cluster``). Ray itself reports a malformed address as a traceback ("Invalid
address format") and retries a dead one for minutes. :func:`check_ray_address` instead:

* parses the address (``host:port``, ``[v6 host]:port``, ``ray://host:port``, ``auto``, ``local``) and refuses
  anything else in one line naming where it came from;
* probes it with one gRPC call to the GCS (``PROBE_TIMEOUT_S``), and refuses a launch when no Ray GCS answers,
  or one answers that wants a token this driver lacks (Ray 2.60's token authentication: ``ray.init`` then
  fails with an ``AuthenticationError``); a dry run only reports the answer (it may run on a machine that
  cannot reach the cluster).

A launch that joins a cluster passes no ``num_cpus`` / ``num_gpus`` to ``ray.init`` (Ray refuses them there);
:attr:`RayAddress.joins` tells the backends so.
"""

from __future__ import annotations

import os
import re
import socket
import time
from dataclasses import dataclass
from typing import Mapping, Optional

from omegaconf import DictConfig, OmegaConf

from recipe.gdro.startup.checks import GDRORecipeError

ADDRESS_KEY = "ray_kwargs.ray_init.address"
PROBE_TIMEOUT_S = 3.0
LOCAL_CLUSTER = "the cluster ray start recorded on this machine"  # <ray temp dir>/ray_current_cluster
RAY_CLIENT_PORT = 10001  # ray://host without a port: Ray Client's default
_HOST_PORT = re.compile(r"^(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<host>[A-Za-z0-9_.-]+)):(?P<port>[0-9]{1,5})$")
REMEDY = (
    "Start the head there (bash run_scripts/ray_node.sh head, docs/cluster.md), correct the address, or unset it "
    "to start a one-node Ray here"
)


@dataclass
class RayAddress:
    """Where ``ray.init`` will go: ``source`` (the key or variable that set it, "" for a one-node Ray started
    here), the ``address`` as given, the parsed ``host`` / ``port``, and the probe's ``answer``."""

    source: str = ""
    address: Optional[str] = None
    host: Optional[str] = None
    port: Optional[int] = None
    answer: str = ""
    alive: Optional[bool] = None

    @property
    def joins(self) -> bool:
        """True when ``ray.init`` joins a running cluster (no ``num_cpus`` / ``num_gpus`` may be passed)."""
        return self.host is not None

    def line(self) -> str:
        if not self.joins:
            return "ray          starts a one-node Ray here (no RAY_ADDRESS, no ray_kwargs.ray_init.address)"
        return f"ray          joins {self.address} ({self.source}): {self.answer}"


class RayJoinError(GDRORecipeError):
    """``ray.init`` failed: the cluster refused this driver (token authentication) or never answered."""

    @classmethod
    def from_init_error(cls, config: DictConfig, error: BaseException, address: Optional[str] = None) -> RayJoinError:
        """One line for ``error`` raised by ``ray.init``: where it went, Ray's first line, the remedy."""
        if address is None:
            try:
                resolved = resolve_ray_address(config)
                address = resolved.address if resolved.joins else None
            except GDRORecipeError:
                address = None
        where = f"joining the Ray cluster at {address}" if address else "starting a one-node Ray here"
        first = (str(error).strip().splitlines() or [""])[0][:300]
        if "authentication" in f"{type(error).__name__} {first}".lower():
            remedy = f"the cluster uses token authentication: {AUTH_REMEDY}"
        elif address:
            remedy = f"check that the head runs at {address} (ray status --address={address}) and this host reaches it"
        else:
            remedy = "see Ray's log in /tmp/ray/session_latest/logs"
        return cls(f"ray.init failed {where} ({type(error).__name__}: {first}); {remedy}")


def parse_ray_address(value: str, source: str) -> tuple[str, int]:
    """``(host, port)`` of ``host:port``, ``[v6]:port`` or ``ray://host[:port]``; one-line error otherwise."""
    text = value.strip()
    client = text.startswith("ray://")
    body = text[len("ray://") :] if client else text
    if client and not re.search(r":[0-9]+$", body):
        body = f"{body}:{RAY_CLIENT_PORT}"
    m = _HOST_PORT.match(body)
    port = int(m.group("port")) if m else 0
    if m is None or not 1 <= port <= 65535:
        raise GDRORecipeError(
            f"{source}={value!r} is not a Ray address: use <host>:<port> (the head's GCS port, 6379 by default, as "
            "ray start --head printed it), ray://<host>:10001 (Ray Client), auto (the cluster ray start runs on this "
            "machine) or local (a new one-node Ray here)"
        )
    return m.group("v6") or m.group("host"), port


GCS_METHOD = "/ray.rpc.NodeInfoGcsService/GetClusterId"  # a cheap call every Ray GCS serves
AUTH_REMEDY = (
    "export RAY_AUTH_MODE=token and the cluster's token (RAY_AUTH_TOKEN, or the file ~/.ray/auth_token / "
    "RAY_AUTH_TOKEN_PATH) before the launch, as run_scripts/ray_node.sh does for the nodes (docs/cluster.md)"
)


def _auth_metadata() -> tuple:
    """The token header Ray's own clients send (none unless ``RAY_AUTH_MODE=token`` and a token is found)."""
    try:
        from ray._private.authentication.grpc_authentication_client_interceptor import (
            _get_authentication_metadata_tuple,
        )

        return _get_authentication_metadata_tuple()
    except Exception:  # noqa: BLE001 - a Ray without token authentication: no header
        return ()


def _token_file_for_local_cluster() -> bool:
    """Ray turns token authentication on by itself for a cluster it finds on this machine when
    ``RAY_AUTH_MODE`` is unset and a token file exists (``RAY_AUTH_TOKEN_PATH`` or ``~/.ray/auth_token``)."""
    if os.environ.get("RAY_AUTH_MODE") is not None:
        return False
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.expanduser("~/.ray/auth_token")
    return os.path.isfile(path) or bool(os.environ.get("RAY_AUTH_TOKEN"))


def _tcp_probe(host: str, port: int, timeout: float) -> tuple[str, str]:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except socket.gaierror as e:
        return "dead", f"host {host!r} does not resolve ({e.strerror or e})"
    except TimeoutError:
        return "dead", f"no answer from {host}:{port} within {timeout:g} s"
    except OSError as e:
        return "dead", f"{host}:{port} does not answer ({e.strerror or e})"
    return "ok", f"{host}:{port} accepts connections"


def probe(host: str, port: int, timeout: float = PROBE_TIMEOUT_S, *, client: bool = False) -> tuple[str, str]:
    """Ask ``host:port`` within ``timeout`` s whether a Ray GCS answers there: one gRPC call (``GCS_METHOD``,
    with the token header Ray's clients send), or for Ray Client (``client``) or TLS (``RAY_USE_TLS``) a TCP
    connect. Returns (``ok`` | ``auth`` | ``dead`` | ``foreign``, what happened): ``auth`` is a GCS that refuses
    this driver's token (or its lack of one), ``foreign`` a server that is no Ray GCS (an HTTP proxy that
    accepts every connection answers a TCP connect, not this call)."""
    if client or os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
        return _tcp_probe(host, port, timeout)
    import grpc

    target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    start = time.monotonic()
    with grpc.insecure_channel(target) as channel:
        call = channel.unary_unary(GCS_METHOD, request_serializer=bytes, response_deserializer=bytes)
        try:
            call(b"", timeout=timeout, metadata=_auth_metadata())
        except grpc.RpcError as e:
            code, detail = e.code(), (str(e.details() or "").splitlines() or [""])[0][:200]
            if code == grpc.StatusCode.UNAUTHENTICATED:
                have = "the token here is not the cluster's" if _auth_metadata() else "RAY_AUTH_MODE is not token here"
                return "auth", f"a Ray GCS answers at {target} but uses token authentication and {have}"
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                return "dead", f"no Ray GCS answers at {target} within {timeout:g} s"
            if code == grpc.StatusCode.UNAVAILABLE:
                return "dead", f"no Ray GCS answers at {target} ({code.name}: {detail})"
            return "foreign", f"{target} answers but is no Ray GCS ({code.name}: {detail})"
    return "ok", f"a Ray GCS answers at {target} ({time.monotonic() - start:.2f} s)"


def _local_cluster(auto: bool) -> Optional[str]:
    """The address ``ray.init`` finds on this machine: the cluster ``ray start`` recorded last, and for
    ``auto`` any running GCS (Ray's ``get_ray_address_from_environment``)."""
    try:
        from ray._private.services import find_bootstrap_address, find_gcs_addresses
    except ImportError:  # another Ray: let ray.init look
        return None
    found = find_bootstrap_address(None)
    if found is None and auto:
        found = next(iter(find_gcs_addresses() or ()), None)
    return found


def resolve_ray_address(config: DictConfig, environ: Optional[Mapping[str, str]] = None) -> RayAddress:
    """Where ``ray.init`` goes for this launch, parsed (module docstring); not probed."""
    environ = os.environ if environ is None else environ
    value = OmegaConf.select(config, ADDRESS_KEY, default=None)
    source = ADDRESS_KEY
    if value in (None, "", "auto") and environ.get("RAY_ADDRESS"):
        value, source = environ["RAY_ADDRESS"], "RAY_ADDRESS"
    value = None if value in (None, "") else str(value).strip()
    if value == "local":
        return RayAddress()
    if value in (None, "auto"):
        found = _local_cluster(auto=value == "auto")
        if found is None:
            if value == "auto":
                raise GDRORecipeError(
                    f"{source}=auto: no Ray cluster runs on this machine; start one (bash run_scripts/ray_node.sh "
                    "head), name the head's <host>:<port>, or unset it to start a one-node Ray here"
                )
            return RayAddress()
        value, source = found, LOCAL_CLUSTER
    host, port = parse_ray_address(value, source)
    return RayAddress(source, value, host, port)


def check_ray_address(
    config: DictConfig,
    *,
    dry_run: bool = False,
    environ: Optional[Mapping[str, str]] = None,
    timeout: float = PROBE_TIMEOUT_S,
) -> RayAddress:
    """Resolve and probe the address ``ray.init`` will use. A launch whose cluster does not answer is refused
    (:class:`GDRORecipeError`, one line, before Ray starts); a dry run reports it in :meth:`RayAddress.line`."""
    address = resolve_ray_address(config, environ)
    if not address.joins:
        return address
    status, answer = probe(address.host, address.port, timeout, client=address.address.startswith("ray://"))
    if status == "auth" and address.source == LOCAL_CLUSTER and _token_file_for_local_cluster():
        status, answer = "ok", f"{answer}; ray.init finds this machine's token file and uses it"
    address.alive = status == "ok"
    address.answer = answer if address.alive else f"{answer}: a launch now is refused"
    if address.alive or dry_run:
        return address
    where = (
        f"{address.source} ({address.address})"
        if address.source == LOCAL_CLUSTER
        else f"{address.source}={address.address}"
    )
    if status == "auth":
        raise GDRORecipeError(f"{where}: {answer}; {AUTH_REMEDY}")
    if address.source == LOCAL_CLUSTER:
        raise GDRORecipeError(
            f"{where}: {answer}. It is gone: `ray stop` forgets it (then this launch starts a one-node Ray here), "
            "or start it again (bash run_scripts/ray_node.sh head)"
        )
    raise GDRORecipeError(f"{where}: {answer}. {REMEDY}")


__all__ = [
    "ADDRESS_KEY",
    "PROBE_TIMEOUT_S",
    "RayAddress",
    "RayJoinError",
    "check_ray_address",
    "parse_ray_address",
    "probe",
    "AUTH_REMEDY",
    "resolve_ray_address",
]
