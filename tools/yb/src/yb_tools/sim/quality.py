"""Decision quality of rejections: would a rejected request have met its SLOs?

A run's rejections are judged against the same run with admission `none` (the same
workload, seed, cluster and settings; only the conductor's admission differs): a
request it rejected is *needless* when, in that counterfactual run, it completed
within both its TTFT and TBT SLOs. Every rejection counts, at arrival and at decode
admission. A run with admission `none` is its own counterfactual, so its rejections
(the conductor's KV accounting, or a decode instance refusing) are never needless.
"""

from __future__ import annotations

from collections.abc import Iterable

from yb_tools.sim.job import Job

REJECTED_FATES = frozenset({"rejected", "decode_rejected"})


def met_both_slos(job: Job, *, ttft_slo_s: float, tbt_slo_s: float) -> bool:
    """The request completed with TTFT and mean TBT within their SLOs."""
    return job.fate == "completed" and job.ttft_s <= ttft_slo_s and job.tbt_s <= tbt_slo_s


def needless_rejections(
    jobs: Iterable[Job], admitted: Iterable[Job], *, ttft_slo_s: float, tbt_slo_s: float
) -> list[str]:
    """The request ids rejected in `jobs` that met both SLOs in `admitted` (the same
    workload run with admission `none`), in `jobs`' order."""
    fine = {
        j.item.request_id
        for j in admitted
        if met_both_slos(j, ttft_slo_s=ttft_slo_s, tbt_slo_s=tbt_slo_s)
    }
    return [
        j.item.request_id for j in jobs if j.fate in REJECTED_FATES and j.item.request_id in fine
    ]
