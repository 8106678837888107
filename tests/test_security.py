"""Security, piece by piece, with the real things: a nats-server that enforces the
per-role permissions `yb up` generates, real metrics listeners on real sockets, the
secret files, and a scan of every package's source for pickle.

What the whole cluster does (API keys through `yb up`, loopback listeners, the
durable log's privacy) is in test_security_cluster.py.
"""

from __future__ import annotations

import ast
import asyncio
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import nats.errors
import nats.js.errors
import psutil
import pytest
from nats.aio.msg import Msg
from prometheus_client import CollectorRegistry, Counter

from yb_core import events as ev
from yb_core import protocol
from yb_core.auth import bearer_token, matches_any
from yb_core.bus import Bus, BusError, BusUnavailable
from yb_core.config import ConfigError, YbConfig, load_config
from yb_core.credentials import (
    cli_nats_config,
    client_api_key,
    ensure_local_secrets,
    load_local_secrets,
)
from yb_core.nats_auth import ROLES, inbox_prefix, role_permissions
from yb_core.netaddr import is_loopback
from yb_core.service import Service
from yb_core.telemetry import MetricsServer
from yb_testkit.fixtures import AuthNats

ROOT = Path(__file__).resolve().parents[1]


# --- helpers ------------------------------------------------------------------------


async def eventually(check: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    """Wait until `check()` holds; fail naming `what` if it never does."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"never happened: {what}")
        await asyncio.sleep(0.02)


async def connect(auth: AuthNats, user: str) -> Bus:
    return await Bus.connect(auth.config(user), f"test-{user}", timeout_s=10)


def refused(bus: Bus, subject: str) -> bool:
    """Whether the server told `bus` that an operation on `subject` was refused
    (nats-py lower-cases the server's message)."""
    return any(f'"{subject.lower()}"' in error.lower() for error in bus.permission_errors)


def admitted(request_id: str, gateway: str = "gateway-0") -> ev.RequestAdmitted:
    return ev.RequestAdmitted(
        request_id=request_id,
        gateway_id=gateway,
        model="m",
        block_size=4,
        block_hashes=[1, 2],
        prompt_tokens=8,
        max_tokens=4,
    )


def scheduled(request_id: str, gateway: str = "gateway-0") -> ev.RequestScheduled:
    return ev.RequestScheduled(
        request_id=request_id,
        gateway_id=gateway,
        prefill_instance="prefill-0",
        decode_instance="decode-0",
    )


def stored(instance: str) -> ev.BlockStored:
    return ev.BlockStored(instance_id=instance, epoch=1, event_id=1, block_hashes=[7], tier="dram")


def up(instance: str, role: ev.Role) -> ev.InstanceUp:
    return ev.InstanceUp(instance_id=instance, role=role, host="host-0")


# Each role's own events: accepted. Anybody else's: refused by the server.
OWN_EVENTS: dict[str, list[ev.AnyEvent]] = {
    "conductor": [
        scheduled("r-c"),
        ev.RequestRejected(request_id="r-c2", gateway_id="gateway-0", reason="full"),
        ev.LoadPrediction(
            instance_id="decode-0", at_time=1.0, predicted_batch=1, predicted_tbt_s=0.1
        ),
        ev.ResyncRequested(instance_id="kvstore-0", requester="conductor-0"),
        ev.ConductorConfigured(instance_id="conductor-0", settings_json="{}"),
        up("conductor-0", "conductor"),
        # Its verdicts on failures: a silent instance is down, its requests cancelled.
        ev.InstanceDown(instance_id="prefill-0", reason="heartbeat timeout"),
        ev.RequestCancelled(request_id="r-c3", reason="prefill-0 down"),
    ],
    "gateway": [
        admitted("r-g"),
        ev.RequestCancelled(request_id="r-g"),
        ev.RequestFinished(request_id="r-g", instance_id="gateway-0", outcome="rejected"),
        up("gateway-0", "gateway"),
    ],
    "prefill": [
        ev.RequestProgress(request_id="r-p", instance_id="prefill-0", stage="prefill_started"),
        ev.RequestFinished(request_id="r-p", instance_id="prefill-0", outcome="failed"),
        ev.TransferFailed(
            request_id="r-p", source_instance="kvstore-0", target_instance="prefill-0", reason="x"
        ),
        stored("prefill-0"),
        up("prefill-0", "prefill"),
    ],
    "decode": [
        ev.RequestProgress(request_id="r-d", instance_id="decode-0", stage="decode_started"),
        ev.RequestFinished(request_id="r-d", instance_id="decode-0", outcome="completed"),
        ev.LoadReport(instance_id="decode-0", role="decode"),
    ],
    "kvstore": [
        stored("kvstore-0"),
        ev.BlocksCleared(instance_id="kvstore-0", epoch=2, event_id=0),
    ],
}
FOREIGN_EVENTS: dict[str, list[ev.AnyEvent]] = {
    # The gateway must not decide for itself, impersonate engines or fake blocks.
    "gateway": [scheduled("r-x"), up("prefill-0", "prefill"), stored("kvstore-0")],
    "prefill": [admitted("r-x"), scheduled("r-x"), ev.InstanceDown(instance_id="decode-0")],
    "decode": [admitted("r-x"), stored("decode-0"), up("prefill-0", "prefill")],
    "kvstore": [
        ev.RequestFinished(request_id="r-x", instance_id="kvstore-0", outcome="completed"),
        scheduled("r-x"),
        stored("kvstore-1"),  # another instance of its own role
    ],
    "conductor": [
        admitted("r-x"),
        stored("kvstore-0"),
        ev.RequestProgress(request_id="r-x", instance_id="prefill-0", stage="prefill_started"),
    ],
}


def _check_role_tables_cover_every_role() -> None:
    assert set(OWN_EVENTS) == set(FOREIGN_EVENTS) == set(ROLES)


_check_role_tables_cover_every_role()


# --- NATS: who may publish and subscribe to what ------------------------------------


@pytest.mark.parametrize("role", ROLES)
async def test_each_role_publishes_its_own_events_and_only_those(
    auth_nats_server: AuthNats, role: str
) -> None:
    admin = await connect(auth_nats_server, "admin")
    await admin.ensure_stream()
    bus = await connect(auth_nats_server, role)
    try:
        for event in OWN_EVENTS[role]:
            assert await bus.publish(event, timeout_s=5.0) > 0, event
        before = await admin.last_sequence()
        for event in FOREIGN_EVENTS[role]:
            subject = ev.subject_for(event)
            with pytest.raises(BusUnavailable):
                await bus.publish(event, timeout_s=0.5)
            await eventually(lambda s=subject: refused(bus, s), f"{role} refused on {subject}")
        # Nothing of it reached the log.
        assert await admin.last_sequence() == before
        assert not any(s for s in bus.permission_errors if "subscription" in s.lower())
    finally:
        await bus.close()
        await admin.close()


async def test_subscriptions_are_confined_to_each_roles_own_subjects(
    auth_nats_server: AuthNats,
) -> None:
    buses = {role: await connect(auth_nats_server, role) for role in ROLES}
    try:
        forbidden = {
            "gateway": [
                protocol.prefill_job_subject("prefill-0"),
                protocol.decode_control_subject("decode-0"),
                protocol.resend_subject("decode-0"),  # it asks, decode answers
                "yb.tok.>",  # every gateway's tokens
                protocol.token_subject("gateway-1", "r1"),
                "_INBOX.>",
                f"{inbox_prefix('prefill')}.>",
                "yb.ev.>",
            ],
            "prefill": [
                protocol.decode_control_subject("decode-0"),
                protocol.resend_subject("decode-0"),
                protocol.prefill_job_subject("prefill-1"),  # another prefill's jobs
                protocol.token_subject("gateway-0", "r1"),
                f"{inbox_prefix('gateway')}.>",
            ],
            "decode": [
                protocol.prefill_job_subject("prefill-0"),
                protocol.prefill_job_subject("decode-1"),  # another decode's piggybacked jobs
                "yb.tok.gateway-0.*",
                protocol.resend_subject("decode-1"),  # another decode's resend requests
            ],
            "kvstore": [protocol.prefill_job_subject("prefill-0"), "yb.tok.>", "_INBOX.>"],
            "conductor": [protocol.prefill_job_subject("prefill-0"), "yb.tok.>", ">"],
        }
        for role, subjects in forbidden.items():
            bus = buses[role]
            for subject in subjects:
                await bus.subscribe(subject)
            await bus.flush()
            for subject in subjects:
                await eventually(lambda b=bus, s=subject: refused(b, s), f"{role} sub {subject}")
        # The subscriptions each role needs are accepted.
        allowed = {
            "gateway": [protocol.token_subject("gateway-0", "r1")],
            "prefill": [protocol.prefill_job_subject("prefill-0")],
            "decode": [
                protocol.decode_control_subject("decode-0"),
                protocol.resend_subject("decode-0"),
                protocol.prefill_job_subject("decode-0"),  # its piggybacked jobs
            ],
        }
        for role, subjects in allowed.items():
            for subject in subjects:
                await buses[role].subscribe(subject)
            await buses[role].flush()
            assert not any(refused(buses[role], s) for s in subjects), buses[role].permission_errors
    finally:
        for bus in buses.values():
            await bus.close()


async def test_the_job_and_token_flow_works_and_nobody_else_can_inject_tokens(
    auth_nats_server: AuthNats,
) -> None:
    gateway = await connect(auth_nats_server, "gateway")
    prefill = await connect(auth_nats_server, "prefill")
    decode = await connect(auth_nats_server, "decode")
    kvstore = await connect(auth_nats_server, "kvstore")
    try:
        tokens = await gateway.subscribe(protocol.token_subject("gateway-0", "r1"))

        async def answer_job(msg: Msg) -> None:
            # Prefill asks decode, as it does to reserve pages, then answers the job.
            reply = await prefill.request(
                protocol.decode_control_subject("decode-0"), b"reserve", timeout_s=5
            )
            await prefill.publish_core(protocol.token_subject("gateway-0", "r1"), b"first")
            await msg.respond(b"accepted:" + reply.data)

        async def answer_control(msg: Msg) -> None:
            await msg.respond(b"reserved")

        async def answer_resend(msg: Msg) -> None:
            # As decode does: the lost chunk again on the token subject, then the answer.
            await decode.publish_core(protocol.token_subject("gateway-0", "r1"), b"first")
            await msg.respond(b"resent")

        await prefill.subscribe(protocol.prefill_job_subject("prefill-0"), cb=answer_job)
        await decode.subscribe(protocol.decode_control_subject("decode-0"), cb=answer_control)
        await decode.subscribe(protocol.resend_subject("decode-0"), cb=answer_resend)
        await prefill.flush()
        await decode.flush()
        reply = await gateway.request(
            protocol.prefill_job_subject("prefill-0"), b"job", timeout_s=5
        )
        assert reply.data == b"accepted:reserved"
        await decode.publish_core(protocol.token_subject("gateway-0", "r1"), b"second")
        # A kvstore cannot write into a request's token stream.
        await kvstore.publish_core(protocol.token_subject("gateway-0", "r1"), b"forged")
        await kvstore.flush()
        await eventually(lambda: refused(kvstore, "yb.tok.gateway-0.r1"), "kvstore refused")
        # Nor can a gateway send decode control messages (only prefill reserves).
        with pytest.raises(BusUnavailable):
            await gateway.request(protocol.decode_control_subject("decode-0"), b"x", timeout_s=0.5)
        await decode.publish_core(protocol.token_subject("gateway-0", "r1"), b"last")
        # A gateway that lost a chunk asks the decode instance to send it again.
        resent = await gateway.request(protocol.resend_subject("decode-0"), b"r1", timeout_s=5)
        assert resent.data == b"resent"
        received = []
        while len(received) < 4:
            msg = await tokens.next_msg(timeout=5)
            received.append(msg.data)
        assert received == [b"first", b"second", b"last", b"first"]
        await eventually(lambda: refused(gateway, "yb.job.decode.decode-0"), "gateway refused")
        assert len(gateway.permission_errors) == 1
        assert not prefill.permission_errors and not decode.permission_errors
    finally:
        for bus in (gateway, prefill, decode, kvstore):
            await bus.close()


async def test_credentials_are_required(auth_nats_server: AuthNats) -> None:
    for cfg in (auth_nats_server.config(""), auth_nats_server.config("gateway", password="no")):
        with pytest.raises(BusUnavailable, match="authorization violation"):
            # The deadline only has to let the server's refusal arrive (the connect
            # retries until then, so the test always waits it out).
            await Bus.connect(cfg, "intruder", timeout_s=10)


async def test_only_the_conductor_owns_its_buckets_and_only_admin_destroys_the_log(
    auth_nats_server: AuthNats,
) -> None:
    admin = await connect(auth_nats_server, "admin")
    await admin.ensure_stream()
    await admin.publish(admitted("r-keep"))
    conductor = await connect(auth_nats_server, "conductor")
    gateway = await connect(auth_nats_server, "gateway")
    try:
        # The conductor's real uses: lease (KV) and snapshots (object store).
        kv = await conductor.jetstream.create_key_value(bucket="yb_conductor_lease", ttl=5)
        assert await kv.create("active", b"conductor-0") > 0
        assert (await kv.get("active")).value == b"conductor-0"
        store = await conductor.jetstream.create_object_store(bucket="yb_conductor")
        await store.put("snapshot", b"x" * 300_000)
        assert (await store.get("snapshot")).data == b"x" * 300_000
        await store.put("snapshot", b"y")  # a second put purges the old chunks
        assert (await store.get("snapshot")).data == b"y"
        # Anyone else: refused.
        js_errors = (nats.errors.Error, nats.js.errors.Error, TimeoutError, BusError)
        with pytest.raises(js_errors):
            await gateway.jetstream.key_value("yb_conductor_lease")
        await eventually(
            lambda: refused(gateway, "$JS.API.STREAM.INFO.KV_yb_conductor_lease"), "kv refused"
        )
        with pytest.raises(js_errors):
            await gateway.jetstream.purge_stream("YB_EVENTS")
        with pytest.raises(js_errors):
            await conductor.jetstream.delete_stream("YB_EVENTS")
        await eventually(
            lambda: refused(conductor, "$JS.API.STREAM.DELETE.YB_EVENTS"), "delete refused"
        )
        # Every role may read the log (it holds no prompts or tokens).
        reader = await gateway.read_ordered()
        first = await reader.next(timeout_s=5)
        assert first is not None and isinstance(first.event, ev.RequestAdmitted)
        await reader.close()
        assert await admin.last_sequence() >= 1
        # And look one subject's newest event up (how a stream finds a verdict that
        # its reader has not delivered yet).
        for role in ROLES:
            bus = await connect(auth_nats_server, role)
            try:
                found = await bus.last_event(ev.subject_for(admitted("r-keep")), timeout_s=5)
                assert found is not None and isinstance(found.event, ev.RequestAdmitted), role
                assert not bus.permission_errors, (role, bus.permission_errors)
            finally:
                await bus.close()
    finally:
        for bus in (gateway, conductor, admin):
            await bus.close()


def test_permission_table_is_derived_from_the_subjects_in_use() -> None:
    gateway = role_permissions("gateway", ["gateway-0"])
    assert "yb.ev.decision.>" not in gateway.publish
    assert not gateway.allow_responses
    conductor = role_permissions("conductor", ["conductor-0"])
    assert "yb.ev.decision.>" in conductor.publish
    assert "yb.tok.>" not in conductor.publish
    # Only a gateway asks for resends, and a decode instance hears only its own.
    resend = protocol.resend_subject("decode-0")
    assert [r for r in ROLES if "yb.resend.*" in role_permissions(r, [f"{r}-0"]).publish] == [
        "gateway"
    ]
    assert [r for r in ROLES if resend in role_permissions(r, [f"{r}-0"]).subscribe] == ["decode"]
    for role in ROLES:
        perms = role_permissions(role, [f"{role}-0"])
        assert perms.subscribe[0] == f"_INBOX.{role}.>"
        assert not any(s in (">", "yb.>", "yb.ev.>", "$JS.API.>") for s in perms.publish)
        assert "$JS.API.STREAM.DELETE.YB_EVENTS" not in perms.publish
    with pytest.raises(ValueError, match="unknown role"):
        role_permissions("intruder")


# --- metrics listeners --------------------------------------------------------------


@pytest.fixture
def registry() -> CollectorRegistry:
    reg = CollectorRegistry()
    Counter("yb_probe_total", "a probe", registry=reg).inc()
    return reg


def listening_addresses(port: int) -> set[str]:
    """The local addresses this process listens on for `port` (from the kernel)."""
    own = psutil.Process()
    return {
        c.laddr.ip
        for c in own.net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port
    }


def test_metrics_need_the_token_when_one_is_set(registry: CollectorRegistry) -> None:
    server = MetricsServer(registry, "127.0.0.1", 0, token="s3cret")
    try:
        url = f"http://127.0.0.1:{server.port}/metrics"
        with httpx.Client(trust_env=False, timeout=5) as client:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
                r = client.get(url, headers=headers)
                assert r.status_code == 401, headers
                assert r.headers["www-authenticate"].startswith("Bearer")
                assert "yb_probe_total" not in r.text
            assert client.get(f"http://127.0.0.1:{server.port}/x").status_code == 401
            ok = client.get(url, headers={"Authorization": "Bearer s3cret"})
            assert ok.status_code == 200 and "yb_probe_total 1.0" in ok.text
            missing = client.get(f"http://127.0.0.1:{server.port}/x", headers=ok.request.headers)
            assert missing.status_code == 404
        assert listening_addresses(server.port) == {"127.0.0.1"}
    finally:
        server.close()


def test_metrics_refuse_the_network_without_a_token(registry: CollectorRegistry) -> None:
    for host in ("0.0.0.0", "::", ""):
        with pytest.raises(ConfigError, match="metrics_token"):
            MetricsServer(registry, host, 0)
    # Loopback without a token: allowed, and open (only this machine can reach it).
    server = MetricsServer(registry, "127.0.0.1", 0)
    try:
        assert httpx.get(f"http://127.0.0.1:{server.port}/metrics", trust_env=False).is_success
    finally:
        server.close()
    # The network with a token: allowed, bound to exactly what was asked.
    server = MetricsServer(registry, "0.0.0.0", 0, token="t")
    try:
        assert listening_addresses(server.port) == {"0.0.0.0"}
    finally:
        server.close()


class _Probe(Service):
    role = "probe"

    async def start(self) -> None:
        self.serve_metrics()

    async def stop(self) -> None:
        pass


async def test_every_service_serves_metrics_with_its_configured_token(tmp_path: Path) -> None:
    token = tmp_path / "metrics_token"
    token.write_text("from-a-file\n")
    cfg = load_config(env={"YB_TELEMETRY__METRICS_TOKEN_FILE": str(token)})
    service = _Probe(cfg)
    await service.start()
    assert service.metrics_address == f"127.0.0.1:{service.metrics_port}"
    url = f"http://{service.metrics_address}/metrics"
    async with httpx.AsyncClient(trust_env=False) as client:
        assert (await client.get(url)).status_code == 401
        ok = await client.get(url, headers={"Authorization": "Bearer from-a-file"})
        assert ok.status_code == 200
    assert listening_addresses(service.metrics_port) == {"127.0.0.1"}
    exposed = load_config(env={"YB_TELEMETRY__METRICS_HOST": "0.0.0.0"})
    with pytest.raises(ConfigError, match="not a loopback address"):
        await _Probe(exposed).start()


def test_loopback_detection() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert is_loopback("127.0.0.5") and is_loopback("[::1]")
    for host in ("0.0.0.0", "::", "", "192.0.2.1", "10.0.0.1", "no-such-host.invalid"):
        assert not is_loopback(host), host


def test_bearer_parsing_and_constant_time_match() -> None:
    assert bearer_token("Bearer abc") == "abc" and bearer_token("bearer  abc ") == "abc"
    assert bearer_token("Basic abc") == "" and bearer_token("") == "" and bearer_token("abc") == ""
    keys = [b"one", b"two"]
    assert matches_any("two", keys) and not matches_any("tw", keys)
    assert not matches_any("", [b""])  # an empty token never matches, even an empty key


# --- secrets on disk and in configuration -------------------------------------------


def test_yb_up_secrets_are_private_and_reused(tmp_path: Path) -> None:
    first = ensure_local_secrets(tmp_path)
    root = Path(first.root)
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    files = [first.api_key_path, first.metrics_token_path] + [
        first.nats_password_path(u) for u in first.nats_passwords
    ]
    assert set(first.nats_passwords) == {*ROLES, "admin"}
    for path in files:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    secrets = [first.api_key, first.metrics_token, *first.nats_passwords.values()]
    assert len(set(secrets)) == len(secrets) and all(len(s) >= 40 for s in secrets)
    assert first.api_key.startswith("yb-")
    first.api_key_path.chmod(0o644)  # someone widened it: narrowed again on use
    again = ensure_local_secrets(tmp_path)
    assert again == first
    assert stat.S_IMODE(first.api_key_path.stat().st_mode) == 0o600
    assert load_local_secrets(tmp_path) == first
    assert load_local_secrets(tmp_path / "elsewhere") is None


def test_tools_find_the_credentials_of_a_data_dir(tmp_path: Path) -> None:
    cfg = load_config(env={"YB_DATA_DIR": str(tmp_path)})
    assert cli_nats_config(cfg, "nats://x:1").user == ""  # nothing generated yet
    assert client_api_key(cfg) == ""
    secrets = ensure_local_secrets(tmp_path)
    nats_cfg = cli_nats_config(cfg, "nats://x:1")
    assert (nats_cfg.url, nats_cfg.user) == ("nats://x:1", "admin")
    assert nats_cfg.resolved_password() == secrets.nats_passwords["admin"]
    assert client_api_key(cfg) == secrets.api_key
    # Explicit settings win over the data dir.
    explicit = load_config(env={"YB_DATA_DIR": str(tmp_path), "YB_NATS__USER": "ops"})
    assert cli_nats_config(explicit, "nats://x:1").user == "ops"
    keyed = load_config(env={"YB_DATA_DIR": str(tmp_path), "YB_GATEWAY__API_KEYS": "k1,k2"})
    assert client_api_key(keyed) == "k1"


def test_secret_settings_read_files_and_fail_clearly(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("a\n# comment\n b # trailing comment\n\n")
    cfg = load_config(
        env={
            "YB_GATEWAY__API_KEYS": "x",
            "YB_GATEWAY__API_KEYS_FILE": str(keys),
            "YB_GATEWAY__ALLOW_UNAUTHENTICATED": "false",
            "YB_NATS__PASSWORD_FILE": str(keys),
        }
    )
    assert cfg.gateway.resolved_api_keys() == ["x", "a", "b"]
    assert cfg.gateway.allow_unauthenticated is False
    missing = YbConfig()
    missing.telemetry.metrics_token_file = str(tmp_path / "absent")
    with pytest.raises(ConfigError, match=r"telemetry\.metrics_token_file"):
        missing.telemetry.resolved_metrics_token()
    (tmp_path / "empty").write_text("\n")
    missing.nats.password_file = str(tmp_path / "empty")
    with pytest.raises(ConfigError, match="is empty"):
        missing.nats.resolved_password()


# --- no pickle anywhere -------------------------------------------------------------

# Modules whose loading runs arbitrary code from the data (or exist to do so).
UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "shelve",
                  "marshal", "copyreg", "pickletools", "jsonpickle"}  # fmt: skip
UNSAFE_CALLS = {"read_pickle", "to_pickle", "unsafe_load", "full_load"}


def _keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _is_true(node: ast.expr | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def pickle_findings(source: str, filename: str = "<src>") -> list[str]:
    """Every use of a pickle-based loader in `source`, as `file:line: what`."""
    found: list[str] = []
    tree = ast.parse(source, filename)
    for node in ast.walk(tree):
        where = f"{filename}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            found += [f"{where}: import {a.name}" for a in node.names
                      if a.name.split(".")[0] in UNSAFE_MODULES]  # fmt: skip
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module.split(".")[0] in UNSAFE_MODULES:
                found.append(f"{where}: from {node.module} import ...")
            elif node.module.split(".")[0] == "torch" and any(a.name == "load" for a in node.names):
                found.append(f"{where}: from torch import load")
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            owner = ast.unparse(func.value) if isinstance(func, ast.Attribute) else ""
            if name in UNSAFE_CALLS:
                found.append(f"{where}: {ast.unparse(func)}()")
            elif name == "load" and owner.split(".")[-1] == "torch":
                if not _is_true(_keyword(node, "weights_only")):
                    found.append(f"{where}: torch.load without weights_only=True")
            elif name == "load" and owner.split(".")[-1] in ("np", "numpy"):
                if _is_true(_keyword(node, "allow_pickle")):
                    found.append(f"{where}: numpy.load(allow_pickle=True)")
            elif name == "load" and owner.split(".")[-1] == "yaml":
                loader = _keyword(node, "Loader") or (node.args[1] if len(node.args) > 1 else None)
                if loader is None or "Safe" not in ast.unparse(loader):
                    found.append(f"{where}: yaml.load without a safe Loader")
            elif name == "__reduce__" or name == "__reduce_ex__":
                found.append(f"{where}: {name}")
    return found


def python_sources() -> Iterator[Path]:
    """Every Python file of every package, service, test and benchmark in the tree."""
    for top in ("shared", "services", "tools", "tests", "benchmarks"):
        for path in sorted((ROOT / top).rglob("*.py")):
            if not any(part in (".venv", "__pycache__", "build") for part in path.parts):
                yield path


def test_no_pickle_anywhere() -> None:
    sources = list(python_sources())
    assert len(sources) > 50  # the scan really covers the tree
    roots = {p.relative_to(ROOT).parts[:2] for p in sources}
    for top, package in (
        ("shared", "core"),
        ("shared", "dataplane"),
        ("shared", "engine"),
        ("tools", "yb"),
    ):
        assert (top, package) in roots
    findings = [
        f for p in sources for f in pickle_findings(p.read_text(), str(p.relative_to(ROOT)))
    ]
    assert findings == []


@pytest.mark.parametrize(
    "snippet",
    [
        "import pickle",
        "import cPickle as p",
        "from dill import loads",
        "import cloudpickle",
        "import joblib",
        "import shelve",
        "from pickle import loads",
        "import torch\ntorch.load('w.pt')",
        "import torch\ntorch.load('w.pt', weights_only=False)",
        "from torch import load",
        "import numpy as np\nnp.load('x.npy', allow_pickle=True)",
        "import pandas as pd\npd.read_pickle('x')",
        "df.to_pickle('x')",
        "import yaml\nyaml.load(text)",
        "import yaml\nyaml.unsafe_load(text)",
    ],
)
def test_the_pickle_scan_finds_what_it_must(snippet: str) -> None:
    assert pickle_findings(snippet), snippet


@pytest.mark.parametrize(
    "snippet",
    [
        "import torch\ntorch.load('w.pt', weights_only=True)",
        "import numpy as np\nnp.load('x.npy')",
        "import yaml\nyaml.load(text, Loader=yaml.SafeLoader)",
        "import yaml\nyaml.safe_load(text)",
        "import msgspec\nmsgspec.msgpack.decode(b'')",
        "# no pickle anywhere: a comment may say so",
    ],
)
def test_the_pickle_scan_lets_safe_code_pass(snippet: str) -> None:
    assert pickle_findings(snippet) == []
