"""Who may publish and subscribe to what on NATS: one user per service role.

A service authenticates as its role (`conductor`, `gateway`, `prefill`, `decode`,
`kvstore`); the operator's tools (`yb status`, `yb replay`, `yb explain`, tests) use
`admin`, which may do everything. The permissions below are derived from what each
role really sends and receives (`events.subject_for`, `protocol`'s job and token
subjects, and the JetStream API calls of `bus.Bus`, the conductor's lease and
snapshot buckets and the gateway's Batch API buckets), so that a role cannot speak
for another:

- only the conductor publishes decisions (`yb.ev.decision.>`), its settings and
  resync requests, and only it touches its lease (KV) and snapshot (object store)
  buckets; it also declares silent instances down (`InstanceDown` for any id) and
  cancels the requests they orphaned;
- the gateway publishes admissions, cancellations and the outcome of requests it
  ended itself, sends jobs to prefill instances, asks decode instances to resend
  lost token chunks (`yb.resend.*`), and receives tokens addressed to it
  (`yb.tok.<its id>.*`) and nothing else; only it touches the Batch API's buckets
  (`batch_api`: files, batches, line results and leases);
- prefill and decode publish progress and completion, stream tokens and answer the
  requests sent to their own job subject (`allow_responses`); prefill alone sends
  decode control messages; decode also takes the jobs planned inside its batch
  (piggybacked) on its own `yb.job.prefill.<its id>`, and resend requests on its own
  `yb.resend.<its id>` (the chunks go again to the stream's token subject, so a
  gateway that asks for another gateway's request still cannot read its tokens);
- a prefill instance that leads a prefill group sends the group's other stages their
  part of a request (`yb.job.stage.<id>`), which each takes on its own;
- prefill and kvstore instances publish block events for their own instance id;
- every instance announces only itself (`yb.ev.instance.*.<its id>`).

Instance ids are part of the grant when the deployment knows them (`yb up`, the
compose file); without them (`None`) a role may use any instance id of its kind of
subject, which still keeps roles apart but not instances of one role.

Reading the event log is not restricted per role: consumers on `YB_EVENTS` (and on
`YB_EVENTS_INSTANCES`, which keeps the newest instance event of each subject of it,
see `Bus.ensure_stream`, and which every role creates and reads alike) are
created through the JetStream API, whose subjects carry no filter an ordered
consumer could be checked against. The log carries no prompt text or token ids (see
tests/test_security_cluster.py), and destructive stream operations (delete, purge,
message delete) are left to `admin`.

Replies and JetStream deliveries go to per-user inboxes: a client connected as
`gateway` uses `_INBOX.gateway.` (`inbox_prefix`), and only that user may subscribe
there, so no role can read another's replies.

`python -m yb_core.nats_auth --compose docker-compose.yml` prints the
authorization block of `deploy/nats-auth.conf`, with passwords read by nats-server
from the environment (`$YB_NATS_PASSWORD_<ROLE>`).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import msgspec

from yb_core import events as ev
from yb_core.config import instance_stream_for

ROLES: Final = ("conductor", "gateway", "prefill", "decode", "kvstore")
ADMIN_USER: Final = "admin"
USERS: Final = (*ROLES, ADMIN_USER)

#: Role -> instance ids of that role; a role missing or mapped to None: any id.
Instances = Mapping[str, Sequence[str] | None]


class Permissions(msgspec.Struct, frozen=True, kw_only=True):
    """The subjects one user may publish to and subscribe to (allow lists: anything
    not listed is refused), and whether it may answer requests sent to it."""

    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    allow_responses: bool = False


class NatsUser(msgspec.Struct, frozen=True, kw_only=True):
    """One user of the server; `permissions` None means every subject (the operator)."""

    name: str
    permissions: Permissions | None = None


def inbox_prefix(user: str) -> str:
    """The reply-inbox prefix of a client connected as `user` (`_INBOX` without one)."""
    return f"_INBOX.{ev.subject_token(user)}" if user else "_INBOX"


def password_env_var(user: str) -> str:
    """The environment variable that holds `user`'s password in the compose setup."""
    return f"YB_NATS_PASSWORD_{user.upper()}"


def _tag(kind: type[ev.Event]) -> str:
    return str(kind.__struct_config__.tag)


def _block_event_tags() -> list[str]:
    tags: list[str] = []
    pending: list[type[ev.Event]] = list(ev.BlockEvent.__subclasses__())
    while pending:
        kind = pending.pop(0)
        tag = kind.__struct_config__.tag
        if isinstance(tag, str):
            tags.append(tag)
        pending.extend(kind.__subclasses__())
    return sorted(tags)


def event_log_api(stream: str) -> tuple[str, ...]:
    """What every service does with the event stream through the JetStream API: look
    it up, create or update it to its settings (`Bus.ensure_stream`), open ordered
    consumers and answer their flow control, read the newest message on a subject
    (`Bus.last_event`). Not delete, purge or remove messages."""
    return (
        "$JS.API.INFO",
        f"$JS.API.STREAM.INFO.{stream}",
        f"$JS.API.STREAM.MSG.GET.{stream}",
        f"$JS.API.STREAM.CREATE.{stream}",
        f"$JS.API.STREAM.UPDATE.{stream}",
        f"$JS.API.CONSUMER.CREATE.{stream}",
        f"$JS.API.CONSUMER.CREATE.{stream}.>",
        f"$JS.API.CONSUMER.INFO.{stream}.*",
        f"$JS.API.CONSUMER.DELETE.{stream}.*",
        f"$JS.FC.{stream}.>",
    )


def owned_stream_api(stream: str) -> tuple[str, ...]:
    """Full control over a stream the role owns (the conductor's buckets)."""
    return (
        f"$JS.API.STREAM.*.{stream}",
        f"$JS.API.STREAM.MSG.*.{stream}",
        f"$JS.API.DIRECT.GET.{stream}",
        f"$JS.API.DIRECT.GET.{stream}.>",
        f"$JS.API.CONSUMER.*.{stream}",
        f"$JS.API.CONSUMER.*.{stream}.>",
        f"$JS.API.CONSUMER.DURABLE.CREATE.{stream}.*",
        f"$JS.API.CONSUMER.MSG.NEXT.{stream}.*",
        f"$JS.ACK.{stream}.>",
        f"$JS.FC.{stream}.>",
    )


def batch_api(bucket: str) -> tuple[str, ...]:
    """Full control over the Batch API's buckets (`yb_gateway.batch_store`): the KV
    buckets `<bucket>`, `<bucket>_lines` and `<bucket>_leases` and the object store
    `<bucket>_files`, and the stream lookup by subject that nats-py's object store
    makes."""
    kv = (bucket, f"{bucket}_lines", f"{bucket}_leases")
    return (
        *(grant for name in kv for grant in (*owned_stream_api(f"KV_{name}"), f"$KV.{name}.>")),
        *owned_stream_api(f"OBJ_{bucket}_files"),
        f"$O.{bucket}_files.>",
        "$JS.API.STREAM.NAMES",
    )


def role_permissions(
    role: str,
    instances: Sequence[str] | None = None,
    *,
    stream: str = "YB_EVENTS",
    snapshot_bucket: str = "yb_conductor",
    batch_bucket: str = "yb_batches",
) -> Permissions:
    """The permissions of `role`, for the given instance ids (None: any id)."""
    ids = [ev.subject_token(i) for i in instances] if instances else ["*"]
    own = [f"yb.ev.instance.*.{i}" for i in ids]
    inbox = f"{inbox_prefix(role)}.>"
    req = "yb.ev.req"
    transfer_failed = f"yb.ev.transfer.{_tag(ev.TransferFailed)}"
    blocks = [f"yb.ev.block.{tag}.{i}" for tag in _block_event_tags() for i in ids]
    progress = [f"{req}.{_tag(ev.RequestProgress)}", f"{req}.{_tag(ev.RequestFinished)}"]
    publish: list[str] = [*event_log_api(stream), *event_log_api(instance_stream_for(stream)), *own]
    subscribe: list[str] = [inbox]
    responds = False
    match role:
        case "conductor":
            lease = f"{snapshot_bucket}_lease"
            publish += [
                "yb.ev.decision.>",
                *(f"yb.ev.conductor.{_tag(ev.ConductorConfigured)}.{i}" for i in ids),
                f"yb.ev.block.{_tag(ev.ResyncRequested)}.*",
                # Its verdicts on failures: an instance silent past the heartbeat
                # timeout is declared down, and the requests it orphaned cancelled.
                f"yb.ev.instance.{_tag(ev.InstanceDown)}.*",
                f"{req}.{_tag(ev.RequestCancelled)}",
                *owned_stream_api(f"OBJ_{snapshot_bucket}"),
                f"$O.{snapshot_bucket}.>",
                # Reading a snapshot back: nats-py's object store looks its stream up
                # by subject (a list of stream names, nothing more).
                "$JS.API.STREAM.NAMES",
                *owned_stream_api(f"KV_{lease}"),
                f"$KV.{lease}.>",
            ]
        case "gateway":
            publish += [
                f"{req}.{_tag(ev.RequestAdmitted)}",
                f"{req}.{_tag(ev.RequestCancelled)}",
                f"{req}.{_tag(ev.RequestFinished)}",
                "yb.job.prefill.*",
                "yb.resend.*",
                *batch_api(batch_bucket),
            ]
            subscribe += [f"yb.tok.{i}.*" for i in ids]
        case "prefill":
            publish += [*progress, transfer_failed, *blocks, "yb.job.decode.*", "yb.tok.>"]
            # A prefill group's lead sends its other stages their part of a request.
            publish += ["yb.job.stage.*"]
            subscribe += [f"yb.job.prefill.{i}" for i in ids]
            subscribe += [f"yb.job.stage.{i}" for i in ids]
            responds = True
        case "decode":
            publish += [*progress, transfer_failed, "yb.tok.>"]
            subscribe += [f"yb.job.decode.{i}" for i in ids]
            # Jobs the conductor planned inside its batch (`decode.piggyback`).
            subscribe += [f"yb.job.prefill.{i}" for i in ids]
            subscribe += [f"yb.resend.{i}" for i in ids]
            responds = True
        case "kvstore":
            publish += [transfer_failed, *blocks]
        case _:
            raise ValueError(f"unknown role {role!r}; roles are {', '.join(ROLES)}")
    return Permissions(
        publish=tuple(dict.fromkeys(publish)),
        subscribe=tuple(dict.fromkeys(subscribe)),
        allow_responses=responds,
    )


def cluster_users(
    instances: Instances | None = None,
    *,
    stream: str = "YB_EVENTS",
    snapshot_bucket: str = "yb_conductor",
    batch_bucket: str = "yb_batches",
) -> list[NatsUser]:
    """Every user of a cluster: one per role, then `admin`."""
    instances = instances or {}
    users = [
        NatsUser(
            name=role,
            permissions=role_permissions(
                role,
                instances.get(role),
                stream=stream,
                snapshot_bucket=snapshot_bucket,
                batch_bucket=batch_bucket,
            ),
        )
        for role in ROLES
    ]
    users.append(NatsUser(name=ADMIN_USER))
    return users


def literal_passwords(passwords: Mapping[str, str]) -> Callable[[str], str]:
    """Passwords written into the config (for a config file only its owner reads)."""
    return lambda user: json.dumps(passwords[user])


def env_passwords(user: str) -> str:
    """Passwords that nats-server reads from its environment when it loads the file."""
    return f"${password_env_var(user)}"


def render_authorization(users: Sequence[NatsUser], password: Callable[[str], str]) -> str:
    """The nats-server `authorization { users = [...] }` block for `users`."""

    def strings(values: Sequence[str], indent: str) -> str:
        inner = "".join(f"{indent}  {json.dumps(v)}\n" for v in values)
        return f"[\n{inner}{indent}]"

    lines = [
        "# One user per Yuebing service role (yb_core.nats_auth); anything not",
        "# allowed below is refused, and clients without credentials are refused.",
        "authorization {",
        "  users = [",
    ]
    for user in users:
        lines += [
            "    {",
            f"      user: {json.dumps(user.name)}",
            f"      password: {password(user.name)}",
        ]
        perms = user.permissions
        if perms is not None:
            lines += [
                "      permissions: {",
                f"        publish: {{ allow: {strings(perms.publish, '        ')} }}",
                f"        subscribe: {{ allow: {strings(perms.subscribe, '        ')} }}",
            ]
            if perms.allow_responses:
                lines.append("        allow_responses: true")
            lines.append("      }")
        lines.append("    }")
    lines += ["  ]", "}"]
    return "\n".join(lines) + "\n"


def compose_instances(compose: Mapping[str, Any]) -> dict[str, list[str]]:
    """Role -> instance ids of a docker-compose file's services (by their
    `YB_NATS__USER` and `--instance-id`)."""
    out: dict[str, list[str]] = {}
    for service in (compose.get("services") or {}).values():
        env = service.get("environment") or {}
        role = str(env.get("YB_NATS__USER", ""))
        command = [str(c) for c in service.get("command") or []]
        if role in ROLES and "--instance-id" in command:
            out.setdefault(role, []).append(command[command.index("--instance-id") + 1])
    return {role: sorted(ids) for role, ids in out.items()}


def render_compose_authorization(compose: Mapping[str, Any]) -> str:
    """`deploy/nats-auth.conf` for a docker-compose file: its roles and instance ids,
    passwords from nats-server's environment."""
    header = (
        "# Generated from docker-compose.yml by `python -m yb_core.nats_auth --compose\n"
        "# docker-compose.yml > deploy/nats-auth.conf`; do not edit by hand.\n"
    )
    return header + render_authorization(cluster_users(compose_instances(compose)), env_passwords)


def main(argv: Sequence[str] | None = None) -> int:
    """Print the authorization block for a docker-compose file."""
    import yaml

    parser = argparse.ArgumentParser(prog="python -m yb_core.nats_auth")
    parser.add_argument("--compose", required=True, help="docker-compose.yml to read")
    args = parser.parse_args(argv)
    compose = yaml.safe_load(Path(args.compose).read_text())
    sys.stdout.write(render_compose_authorization(compose))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
