"""NATS grants for elastic compose: deploy/nats-auth-elastic.conf.

    python -m yb_tools.compose_actuator.nats_grants docker-compose.yml \\
        > deploy/nats-auth-elastic.conf

The grants of `yb_core.nats_auth` for the compose file's services, except that the
engine roles (prefill, decode) may take any instance id: the actuator makes ids up as
it adds engines (`prefill-<k>`). The other roles keep the ids of the compose file.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from yb_core.nats_auth import cluster_users, compose_instances, env_passwords, render_authorization
from yb_tools.compose_actuator.clone import ENGINE_ROLES

HEADER = (
    "# Generated from docker-compose.yml for docker-compose.elastic.yml by `python -m\n"
    "# yb_tools.compose_actuator.nats_grants docker-compose.yml >\n"
    "# deploy/nats-auth-elastic.conf`; do not edit by hand. Engines take any instance id.\n"
)


def render_elastic_authorization(compose: Mapping[str, Any]) -> str:
    """The authorization block of deploy/nats-auth-elastic.conf for `compose`."""
    instances = {r: ids for r, ids in compose_instances(compose).items() if r not in ENGINE_ROLES}
    return HEADER + render_authorization(cluster_users(instances), env_passwords)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    sys.stdout.write(render_elastic_authorization(yaml.safe_load(Path(args[0]).read_text())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
