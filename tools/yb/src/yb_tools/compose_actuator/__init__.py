"""The planner's actuator for Docker Compose: scales a compose project's prefill and
decode containers as the conductor's planner decides (`PoolPlanned`).

- `docker_api`: the Docker Engine API calls it makes, over the daemon's unix socket;
- `clone`: a new engine container's create request, cloned from one of its role;
- `actuator`: the log follower that applies `yb_tools.cli.elastic.PoolBook`'s steps.

`python -m yb_tools.compose_actuator` runs it (docker-compose.elastic.yml's
`planner-actuator` service). It imports only yb_core and the yb tool's own light
modules, so that its image carries neither torch nor UCX (tests/test_layering.py).
"""
