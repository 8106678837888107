"""`yb bench`: real load against a gateway through the OpenAI API, streamed as SSE.

A module per idea:

- `tokens`: deterministic pseudo-random token blocks (equal ids give equal tokens);
- `workloads`: what to send and when (a Mooncake trace replayed, or shared prefixes);
- `client`: one request over HTTP/SSE, timed, with a deadline;
- `runner`: open-loop arrivals, a concurrency cap, clean stop;
- `report`: statistics, the table and the flat JSON figures;
- `plot`: the PNG of TTFT and inter-token latency.

The front end is `yb_tools.cli.bench`.
"""
