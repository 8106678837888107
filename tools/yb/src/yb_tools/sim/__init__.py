"""`yb sim`: a discrete-event simulator in virtual time around the real conductor.

A Mooncake-format trace drives simulated prefill, decode and kvstore instances whose
timing comes from a cost model; the conductor (`Conductor.apply`, the production
code path) sees the same events it sees live and its decisions are obeyed. Several
policies run side by side on the same workload.

- `params`: the cluster, limits and SLOs of a run;
- `workload`: the trace as arrival times, lengths and block keys;
- `kvstore`, `prefill`, `decode`: the simulated instances;
- `job`: one request's journey; `simulator`: one policy's event loop;
- `results`: the figures; `runner`: several policies; `report`, `plots`, `progress`:
  what people see.
"""
