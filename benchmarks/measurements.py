"""Render docs/measurements.md from benchmarks/results/*.json.

    python benchmarks/measurements.py            # write the page
    python benchmarks/measurements.py --check    # exit 1 if the page is not a fresh render

One section per results file (benchmarks/record.py writes them): what the benchmark
measures, every figure with its meaning, the machine, the commit and the UTC time it was
measured, and the command that reproduces it. The meaning of each figure is kept here,
beside its key; a figure without one stops the render, so the page explains every
number it shows. Comparison files (benchmarks/compare.py) are evidence kept beside the
results and are not rendered. tests/test_measurements.py runs `--check`, so the page
cannot disagree with the JSON.
"""

from __future__ import annotations

import argparse
import difflib
import re
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from record import (
    BENCHMARKS,
    RESULTS_DIR,
    ROOT,
    BenchmarkRecord,
    ComparisonRecord,
    FaultTableRecord,
    Figure,
    Machine,
    Provenance,
    ResultsFile,
    StabilityRecord,
    read,
)

PAGE = ROOT / "docs" / "measurements.md"

# What each benchmark measures, in a sentence or two (its module docstring has the rest).
SUMMARIES: dict[str, str] = {
    "sim_capacity": (
        "Request capacity in `yb sim` (`--capacity`): the highest arrival rate at which at "
        "least 90% of the synthetic trace's requests meet both SLOs, for the conductor "
        "(8 prefill + 8 decode) and for the paper's vLLM baseline `coupled` on the same "
        "16 instances (each prefilling and decoding its own requests, chunked prefill "
        "piggybacked on decode steps, a prefix cache each), with the paper's engine model. "
        "Simulated in virtual time: the same code gives the same figures on any machine."
    ),
    "sim_tp": (
        "Tensor-parallel degrees in `yb sim`: LLaMA2-70B (`llama2-70b-a800`) on the "
        "synthetic trace, the matrix's two shapes of 8-device instances (8 prefill + 8 "
        "decode: 128 devices; 8 + 1: 72) laid out again at the same device count with "
        "prefill and decode at TP=8, prefill at TP=8 and decode at TP=4, both at TP=4, and "
        "prefill at TP=4 and decode at TP=8; the trace at 1x and 2x, the conductor with "
        "admission `predicted`, SLOs TTFT 30 s and TBT 100 ms. Each instance is timed by "
        "the profile at its degree (`CostModel.at_degree`: the work split over the ranks "
        "plus two all-reduces per layer, decode KV room = memory less the weights held "
        "once per instance, loads over one lane per device). Simulated in virtual time: "
        "the same code gives the same figures on any machine."
    ),
    "sim_retention": (
        "What the KV pool keeps, in `yb sim`: each kvstore's own LRU against the "
        "conductor's retention advice (`RetentionPlanned`: blocks of a class rarely "
        "reused, by their uses and their chain head's, counted older, new blocks of such "
        "a class dropped first, copies demoted, the blocks a placed request will read "
        "kept until read), "
        "against Belady's offline optimum (every kvstore evicts "
        "the block whose next use in the trace is farthest) as the limit, and the "
        "retention with hot-prefix replication; Mooncake's synthetic trace, "
        "conversations and shared system prompts, each host's pool cut until it "
        "evicts, the paper's engine model, 8 prefill + 8 decode instances; each also "
        "over 4 jitter and workload seeds, since a queue at its limit moves a hit ratio "
        "by a few points between runs whose engines differ by 0.1%. Simulated in "
        "virtual time: the same code gives the same figures on any machine."
    ),
    "sim_elastic": (
        "Elastic pools in `yb sim`: the conductor's planner (`PoolPlanned`: a forecast "
        "of the load priced with the cost model, hysteresis, a budget) against every "
        "static split of the same 8 instances, found with hindsight, and against the "
        "HorizontalPodAutoscaler's utilisation-threshold rule; a day compressed into an "
        "hour with a 4x peak and a phase change from long prompts to long answers, the "
        "paper's engine model, instances up 60 s after the decision to add them. "
        "Simulated in virtual time: the same code gives the same figures on any machine."
    ),
    "sim_batch": (
        "Batch lines filling idle capacity in `yb sim`: interactive traffic at 0.5x, 1x "
        "and 1.5x of the cluster's capacity on Mooncake's synthetic trace and the "
        "conversation workload (the paper's engine model, 8 prefill + 8 decode), alone, "
        "beside a backlog of Batch API lines held back by the conductor unless they fit "
        "in idle capacity (`idle`), and beside the same backlog sent as ordinary `flex` "
        "requests (`naive`); in both, prefill engines pause a line's prefill once the "
        "layer in progress ends (one 80th of a 512-token chunk) for interactive work. "
        "Simulated in virtual time: the same code gives the same figures on any machine."
    ),
    "elastic_live": (
        "Elastic pools live: `yb up --elastic --max-instances 4` (the tiny model, 1 prefill "
        "+ 1 decode to start; the planner every 5 s over a 30 s window, 10 s ahead, "
        "shrinking after 30 s) under a load step from `yb bench`'s client: a low rate, a "
        "high one that one prefill instance cannot serve within the TTFT SLO as the "
        "conductor's cost model prices a prompt, and the low rate again. How long until "
        "the pool grows, TTFT by the phase each request was sent in, and the drains once "
        "the load falls, from the client's measurements and the cluster's log. All "
        "engines share the machine's cores: an added instance adds no compute here, so "
        "the TTFT figures show the step, not what a grown pool buys."
    ),
    "batch_live": (
        "The Batch API live, through `yb up` (the default model, its default shape, SLOs "
        "TTFT 2 s and TBT 0.5 s): a batch of 500 short chat lines (16 tokens each) "
        "uploaded and created with the official `openai` client beside an open-loop "
        "interactive load from `yb bench`'s client (Poisson arrivals at 0.5 requests/s, "
        "64-token prompts, 16 tokens each), the same load measured alone before it, "
        "beside the batch, and alone again after it (the machine's drift). The "
        "interactive TTFT and TBT of each phase, the batch's completion time, whether "
        "every line was answered exactly once in the output file, and how often the "
        "conductor held a line back (`batch_held`) from the cluster's log. Every engine "
        "shares the machine's cores, so a batch line admitted to idle engine time still "
        "takes CPU from the interactive requests computed beside it."
    ),
    "cpp": (
        "Chunked pipeline parallelism at the engine level: time to first token of a long "
        "prompt over a group of stage processes (each holding only its layers, one torch "
        "thread each, chunks pipelined, hidden states passed over UCX as a msgspec header "
        "plus the raw bytes, one reservation per chunk: `yb_dataplane.activations`) "
        "against one process that is a single stage of every layer, served the same way, "
        "alternating in the same run. A group of more processes than the machine has "
        "cores cannot run its stages in parallel, and on a busy machine the ratio also "
        "depends on how the scheduler shares the cores between the two ways; the CPU "
        "seconds show what idle cores would allow."
    ),
    "cpp_cluster": (
        "Chunked pipeline parallelism through a running cluster (`yb up`, the default "
        "model): a long prompt's time to first token, as a client sees it, on a prefill "
        "group of stage instances against one whole-model prefill instance, alternating "
        "in the same cluster (the other path's process SIGSTOPped until the conductor "
        "declares it dead, so each request's path is arranged by construction). Every "
        "service runs on the same cores as the stages."
    ),
    "piggyback": (
        "Short prompts prefilled inside a decode engine's batch (mixed steps) against a "
        "separate prefill engine and an in-process page hand-off (no UCX, no messages, no "
        "queue), at light load, interleaved in one process: time to first token of "
        "32-128-token prompts, and the running streams' time between tokens with and "
        "without piggybacking, under the gateway's default TBT SLO and a tight one."
    ),
    "sim_matrix": (
        "The scheduling matrix of `yb sim --matrix`: the conductor (`mooncake`) against "
        "every peer policy on the synthetic trace and three generated workloads "
        "(shared-prefix, multi-turn, tool-agent), both engine models, 1x and 2x speed, "
        "8P+8D and 8P+1D, and llm-d's shared-prefix ladder (150 groups of 5 users, load "
        "stepping up to 60 requests/s) in its own setting, `llama2-70b-a800` at 1x, 8P+8D. "
        "A setting is won when the conductor's mean and p90 TTFT are at "
        "or below the best peer's, its goodput at or above it, and it neither rejects "
        "nor loses to KV exhaustion a request where some peer meets every SLO. The "
        "simulated decode instances hold KV as the engine does (the prompt's pages from "
        "the prefill's start, a page more as the output grows, the newest request ended "
        "when none is free). Plus the setting Dynamo published a replay of "
        "(synthetic trace, `dynamo-mocker`, 8+8, admission `none`; Dynamo 1.6.1: mean "
        "TTFT 168.5 ms, hit ratio 0.529). Simulated in virtual time with fixed seeds: "
        "only the wall-clock figures depend on the machine. The whole matrix is in "
        "docs/sim_matrix.json and its table in docs/simulation.md; with `--seeds`, every "
        "seed's matrix in docs/sim_seeds.json and the settings across the seeds there too."
    ),
    "families": (
        "Every model family the engine computes, at one size class (hidden 256, 4 layers; "
        "random weights that transformers builds offline, loaded as a user's directory): "
        "prefill and decode throughput of `ModelRunner` and the KV bytes one token keeps. "
        "Then a mixture of experts against a dense model with the same active parameters, "
        "in the same run, and MLA's latent against per-head K/V at Kimi K2's and "
        "DeepSeek-V3's real sizes (from their configs: the bytes are arithmetic, the same "
        "on any machine). Timings are medians of `--repeats` runs."
    ),
    "prefix_overlap": (
        "A 4,096-token prompt whose first 3,584 tokens are in a kvstore (a real kvstore "
        "service over UCX, the default model in float32 on the CPU): the prefix's load "
        "alone, the compute of the 512 new tokens alone, the load then the compute, and "
        "the compute running on the prefix as it lands layer by layer (what the prefill "
        "does with `overlap_prefix_load`), alternating round by round in one process "
        "(medians of `rounds`; the two loading ways' logits checked equal every round). "
        "Then `benchmarks/e2e_reuse.py`'s TTFT through a `yb up` cluster with prompts of "
        "the same length, the prefix fetched from the other host's kvstore, with the "
        "prefill overlapping and loading first; it sends each prompt twice, so the "
        "second time reuses every full block (4,032 tokens), not only the first 3,584."
    ),
    "kv_fp8": (
        "The 8-bit KV cache (`model.kv_dtype` `fp8_e4m3`: FP8 e4m3 rows with a float32 "
        "scale each) against float32 KV on the default model (float32 weights), in the "
        "same run. Accuracy, in one process, greedy: each of `prompts` fixed chat prompts "
        "(20 subjects x 10 asks) generates `tokens_per_prompt` tokens with float32 KV; "
        "the same sequences fed through an 8-bit cache (teacher forcing) give the share "
        "of positions whose argmax is the reference token and the |difference| of that "
        "token's log-probability; the 8-bit cache also generates on its own (whole "
        "output identical or not); and the perplexity of a fixed public-domain text "
        "through the pages in 64-token chunks. Then the bytes of one pool block, the "
        "time `benchmarks/transfer.py` takes to move a 2,048-token prefix's pages over "
        "UCX between two processes, and `benchmarks/e2e_reuse.py`'s TTFT with a "
        "2,048-token prefix fetched from the other host's kvstore through a `yb up` "
        "cluster, once per KV dtype. Compute is float32 on the CPU: pages are "
        "dequantized as attention gathers them."
    ),
    "tensor_parallel": (
        "Tensor-parallel instances on this machine's CPU (gloo, float32): prefill of a "
        "2,048-token prompt and one decode step of 8 sequences of 512 tokens, by one "
        "process with every core and by a tensor-parallel instance whose ranks share the "
        "same cores, alternating in one run (medians of `--rounds`). A random Llama of "
        "SmolLM2-135M's size with 8 heads and 4 KV heads at TP=2 (SmolLM2's 9 heads do "
        "not cut in two), and the default model itself at TP=3. Then the KV bytes a "
        "prompt's pages move from a prefill of degree a to a decode of degree b, over "
        "real UCX, from and into the pages as each side's ranks hold them: per-head K/V "
        "(the same Llama) and a DeepSeek-V3-shaped latent (tiny: 4 layers, a latent of "
        "40), against sending the latent to every decode rank."
    ),
    "hf_backend": (
        "Two ways to compute a model family, on the default model (a Llama) in float32 "
        "over the same weights and the same paged KV cache and attention backend, "
        "alternating in one run: the model runner's own forward pass (`runner`), and "
        "transformers' own decoder modules driven layer by layer with the paged attention "
        "registered in transformers' `AttentionInterface` (`hf_modules`, as vLLM's "
        "Transformers backend). Greedy argmax only, no sampling. The run fails unless "
        "their logits agree within 1e-4. Medians of `--repeats` runs."
    ),
    "engine": (
        "Prefill and decode throughput of the model runner (`yb_engine`) in one process, "
        "against transformers' own forward pass of the same model on the same tokens, "
        "measured interleaved. Every figure is the median of `--repeats` runs."
    ),
    "transfer": (
        "KV transfer between two processes over UCX (`KVSender.send_segments` to a "
        "`KVReceiver`), checksums and commit included, against a plain memcpy of the same "
        "bytes in the same run. Payloads are cut into 2 MiB pages (size/8 under 16 MiB) and "
        "sent in segments of at most 16 MiB. Medians over `--repeat` runs."
    ),
    "containers_transfer": (
        "The same KV transfer (`benchmarks/transfer.py`, 2 MiB pages) between two Docker "
        "containers of the kvstore image, placed two ways, against two processes on the "
        "host, each with memcpy timed in the same run: `tcp` is how the compose files run "
        "the services (separate namespaces, a bridge network); `cma` shares the "
        "receiver's PID and IPC namespaces, with CAP_SYS_PTRACE. Medians over `--repeat` "
        "runs."
    ),
    "conductor": (
        "The conductor alone on one pinned core: Mooncake's synthetic trace replayed through "
        "a simulated cluster (64 prefill instances each with its host's kvstore, 16 decode "
        "instances, a million unrelated blocks in the index), then the resulting log "
        "decided again and replayed. Medians of `--repeats` runs. Figures suffixed "
        "`_<P>x<D>` are the same run repeated at P prefill and D decode instances "
        "(`--shapes`)."
    ),
    "timeline": (
        "The scheduling timeline report (`yb replay --report`, docs/timeline.md) of a "
        "10,000-request simulation log (Mooncake's synthetic trace repeated, 8 prefill and 8 "
        "decode instances), opened from file:// in fresh tabs of Debian's headless chromium."
    ),
    "grammar": (
        "Decode steps of the default model on the CPU (float32), B sequences of one chat "
        "prompt asking for JSON, through `DecodeBatcher.step` (sampling and detokenizing "
        "included), unconstrained and held to a JSON schema by an llguidance grammar, runs "
        "interleaved in one process. Medians of `--repeats` runs."
    ),
    "e2e_chat": (
        'One greedy streamed chat request ("What is the capital of France?") through a '
        "whole `yb up` cluster with the default model, sent one at a time."
    ),
    "overhead": (
        "The request path with almost no compute: `max_tokens: 1` completions through a "
        "`yb up` cluster of the tiny random model, sent by a keep-alive HTTP/1.1 client "
        "(httptools on uvloop, one connection per request in flight) one at a time, "
        "then 16 and 64 in flight, on a cluster that exports no spans (as users run it); "
        "the per-hop breakdown of the one-at-a-time load comes from a second `yb up` whose "
        "services export every span to a real OTLP receiver, read from each request's "
        "trace (docs/observability.md lists the spans)."
    ),
    "e2e_reuse": (
        "Time to first token through a `yb up` cluster (2 prefill instances on two logical "
        "hosts, each with its kvstore, 1 decode) for a prompt computed from scratch, against "
        "the same prompt whose prefix sits in the *other* host's kvstore and is fetched over "
        "UCX. Medians over the rounds."
    ),
    "overload": (
        "A burst of `--factor` times the cluster's naive capacity sent at one instant "
        "through the OpenAI API of a `yb up` cluster: how each request ended, the accepted "
        "ones against the SLOs, and every process's memory."
    ),
    "compose": (
        "`docker-compose.yml` built and started as `deploy/compose-smoke.sh` does (the "
        "base image and torch's index chosen by `deploy/compose-env.sh`): from `up -d "
        "--build` until every service is healthy, with no image or build cache of the "
        "project (cold) and again with both (warm, volumes removed in between); the first "
        "chat; each container's memory idle and under a short `yb bench shared-prefix`."
    ),
}

# (key pattern, meaning): the first pattern that matches the whole key describes it; the
# meaning may name the pattern's groups as {0}, {1}.
#: What the end-to-end benchmarks say of `yb up`'s memory (`yb_testkit.memory`).
MEMORY_FIGURES: list[tuple[str, str]] = [
    (
        "peak_rss_mb_total",
        "`yb up`'s peak resident memory, MiB: the sum of every process's own peak "
        "(VmHWM), the launcher's included; a page processes share (libtorch, the mapped "
        "weights) counts once per process",
    ),
    (r"peak_rss_mb_(\w+)", "peak resident memory of {0}, MiB"),
    (
        "peak_pss_mb_total",
        "the highest sum of the processes' proportional set sizes, read after each "
        "request, MiB: a shared page counts once, so this is what the cluster takes from "
        "the machine",
    ),
    (r"peak_pss_mb_(\w+)", "highest proportional set size of {0} read, MiB"),
]

DESCRIPTIONS: dict[str, list[tuple[str, str]]] = {
    "sim_capacity": [
        ("profile", "the engine model"),
        ("prefill_instances", "the conductor's prefill instances"),
        ("decode_instances", "the conductor's decode instances"),
        ("coupled_instances", "the baseline's instances (the same total)"),
        ("requests", "requests of the trace"),
        ("ttft_slo_s", "the TTFT SLO, s"),
        ("tbt_slo_s", "the TBT SLO, s"),
        ("target_attainment", "the share of requests within both SLOs a rate must keep"),
        (r"(coupled|mooncake)_capacity_rps", "capacity of `{0}`, requests/s"),
        (r"(coupled|mooncake)_speedup", "the trace's speedup at `{0}`'s capacity"),
        (r"(coupled|mooncake)_slo_attainment", "share of requests within both SLOs there"),
        (r"(coupled|mooncake)_capped", "whether `{0}` held even at the search's top rate"),
        ("capacity_ratio", "the conductor's capacity over the baseline's (goal >= 1.28)"),
    ],
    "sim_tp": [
        ("profile", "the engine model"),
        ("requests", "requests of the trace"),
        (
            r"dev(\d+)_([\d.]+)x_p(\d+)d(\d+)_devices",
            "devices the engines span ({0}-device budget, trace at {1}x, prefill TP={2}, "
            "decode TP={3})",
        ),
        (
            r"dev(\d+)_([\d.]+)x_p(\d+)d(\d+)_instances",
            "prefill + decode instances ({0} devices, {1}x, prefill TP={2}, decode TP={3})",
        ),
        (
            r"dev(\d+)_([\d.]+)x_p(\d+)d(\d+)_goodput_rps",
            "requests/s completed within both SLOs ({0} devices, {1}x, prefill TP={2}, "
            "decode TP={3})",
        ),
        (
            r"dev(\d+)_([\d.]+)x_p(\d+)d(\d+)_slo_attainment",
            "share of requests within both SLOs ({0} devices, {1}x, prefill TP={2}, decode TP={3})",
        ),
        (
            r"dev(\d+)_([\d.]+)x_p(\d+)d(\d+)_ttft_p(\d+)_s",
            "p{4} time to first token, s ({0} devices, {1}x, prefill TP={2}, decode TP={3})",
        ),
        (
            r"dev(\d+)_([\d.]+)x_p(\d+)d(\d+)_tbt_p(\d+)_s",
            "p{4} of requests' mean time between tokens, s ({0} devices, {1}x, prefill "
            "TP={2}, decode TP={3})",
        ),
        (
            r"dev(\d+)_([\d.]+)x_p(\d+)d(\d+)_rejected",
            "requests refused ({0} devices, {1}x, prefill TP={2}, decode TP={3})",
        ),
        (
            r"dev(\d+)_([\d.]+)x_best",
            "the degrees (p<prefill TP>d<decode TP>) of the highest goodput at {0} devices, "
            "{1}x (ties: the lower p90 TTFT)",
        ),
    ],
    "sim_elastic": [
        ("profile", "the engine model"),
        ("budget", "instances the pools may hold in all"),
        (r"(\w+?)_best_static", "the static split with the most goodput (`{0}`)"),
        (
            r"(\w+?)_(p\d+_d\d+|(?:threshold|forecast)_from_\w+)_goodput_rps",
            "requests a second finished within both SLOs (`{0}`, `{1}`)",
        ),
        (
            r"(\w+?)_(p\d+_d\d+|(?:threshold|forecast)_from_\w+)_instance_hours",
            "engine instance-hours held, starting and draining included (`{0}`, `{1}`)",
        ),
        (
            r"(\w+?)_(p\d+_d\d+|(?:threshold|forecast)_from_\w+)_slo_attainment",
            "share of requests within both SLOs (`{0}`, `{1}`)",
        ),
        (
            r"(\w+?)_(p\d+_d\d+|(?:threshold|forecast)_from_\w+)_ttft_p90_s",
            "p90 time to first token, s (`{0}`, `{1}`)",
        ),
        (
            r"(\w+?)_((?:threshold|forecast)_from_\w+)_actions",
            "pool actions carried out: adds, drains, moves (`{0}`, `{1}`)",
        ),
        (
            r"(\w+?)_((?:threshold|forecast)_from_\w+)_goodput_vs_best",
            "goodput over the best static split's (`{0}`, `{1}`; goal on `daily` >= 0.97)",
        ),
        (
            r"(\w+?)_((?:threshold|forecast)_from_\w+)_hours_saved_vs_best",
            "1 - instance-hours over the best static split's (`{0}`, `{1}`; goal on "
            "`daily` >= 0.25)",
        ),
        (
            r"(\w+?)_((?:threshold|forecast)_from_\w+)_start",
            "the split the elastic run starts at (`{0}`, `{1}`)",
        ),
    ],
    "sim_batch": [
        ("profile", "the engine model"),
        ("window_s", "seconds from the backlog's start to its lines' deadline"),
        ("limit", "interactive requests kept (0: every one of the trace)"),
        (
            r"(\w+?)_x(\d+)_(\d+)_(none|idle|naive)_goodput_rps",
            "interactive requests a second finished within both SLOs (`{0}`, load {1}.{2}x, `{3}`)",
        ),
        (
            r"(\w+?)_x(\d+)_(\d+)_(none|idle|naive)_ttft_p90_s",
            "p90 time to first token of the interactive requests, s (`{0}`, {1}.{2}x, `{3}`)",
        ),
        (
            r"(\w+?)_x(\d+)_(\d+)_(none|idle|naive)_slo_attainment",
            "share of interactive requests within both SLOs (`{0}`, {1}.{2}x, `{3}`)",
        ),
        (
            r"(\w+?)_x(\d+)_(\d+)_(idle|naive)_goodput_change",
            "interactive goodput against the same run without the backlog, a signed "
            "fraction (`{0}`, {1}.{2}x, `{3}`; goal for `idle` >= -0.01)",
        ),
        (
            r"(\w+?)_x(\d+)_(\d+)_(idle|naive)_ttft_p90_change",
            "interactive TTFT p90 against the same run without the backlog, a signed "
            "fraction (`{0}`, {1}.{2}x, `{3}`; goal for `idle` <= 0.01)",
        ),
        (
            r"(\w+?)_x(\d+)_(\d+)_idle_seeds",
            "jitter seeds the `idle` way was repeated with, each job within 0.1% of the cost "
            "model's time (`{0}`, {1}.{2}x)",
        ),
        (
            r"(\w+?)_x(\d+)_(\d+)_idle_ttft_p90_change_mean",
            "mean over those seeds of each one's TTFT p90 change against its own run "
            "without the backlog (`{0}`, {1}.{2}x; goal <= 0.01)",
        ),
        (
            r"(\w+?)_x(\d+)_(\d+)_idle_ttft_p90_change_sd",
            "its standard deviation over the seeds (`{0}`, {1}.{2}x)",
        ),
        (
            r"(\w+?)_x(\d+)_(\d+)_idle_goodput_change_mean",
            "mean over those seeds of each one's goodput change against its own run "
            "without the backlog (`{0}`, {1}.{2}x; goal >= -0.01)",
        ),
        (
            r"(\w+?)_x(\d+)_(\d+)_(idle|naive)_lines",
            "batch lines in the backlog (`{0}`, {1}.{2}x, `{3}`)",
        ),
        (
            r"(\w+?)_x(\d+)_(\d+)_(idle|naive)_lines_completed",
            "lines finished inside their window (`{0}`, {1}.{2}x, `{3}`)",
        ),
        (
            r"(\w+?)_x(\d+)_(\d+)_(idle|naive)_lines_timed_out",
            "lines refused until their deadline (`{0}`, {1}.{2}x, `{3}`)",
        ),
        (
            r"(\w+?)_x(\d+)_(\d+)_(idle|naive)_idle_used",
            "share of the idle prefill instance-seconds over the interactive window the "
            "lines' prefills took (`{0}`, {1}.{2}x, `{3}`; goal at 0.5x >= 0.8)",
        ),
        (
            r"(\w+?)_x(\d+)_(\d+)_(idle|naive)_batch_makespan_s",
            "when the last line finished inside the window, s (`{0}`, {1}.{2}x, `{3}`)",
        ),
    ],
    "sim_retention": [
        ("profile", "the engine model"),
        (r"(\w+?)_(\d+)k_requests", "requests of the `{0}` workload"),
        (
            r"(\w+?)_(\d+)k_(lru|retention|belady|replicated)_hit_ratio",
            "share of prefilled prompt tokens taken from the pool (`{0}`, {1}k tokens of "
            "pool per host, kept by `{2}`)",
        ),
        (
            r"(\w+?)_(\d+)k_(lru|retention|belady|replicated)_ttft_mean_s",
            "mean time to first token, s (`{0}`, {1}k tokens per host, `{2}`)",
        ),
        (
            r"(\w+?)_(\d+)k_(lru|retention|belady|replicated)_ttft_p90_s",
            "p90 time to first token, s (`{0}`, {1}k tokens per host, `{2}`)",
        ),
        (
            r"(\w+?)_(\d+)k_(lru|retention|belady|replicated)_slo_attainment",
            "share of requests within both SLOs (`{0}`, {1}k tokens per host, `{2}`)",
        ),
        (
            r"(\w+?)_(\d+)k_(lru|retention|belady|replicated)_rejected",
            "requests refused (`{0}`, {1}k tokens per host, `{2}`)",
        ),
        (
            r"(\w+?)_(\d+)k_gap_closed",
            "share of Belady's hit-ratio gain over LRU that the retention reaches (`{0}`, "
            "{1}k tokens per host; empty: no gap)",
        ),
        (
            r"(\w+?)_(\d+)k_seeds_gap_closed",
            "the same over the jitter and workload seeds, of their mean hit ratios "
            "(`{0}`, {1}k tokens per host)",
        ),
        (
            r"(\w+?)_(\d+)k_seeds_gap_closed_(min|max)",
            "the {2} of each seed's share of the gap closed (`{0}`, {1}k tokens per host)",
        ),
    ],
    "cpp": [
        ("model", "the model measured"),
        ("chunk_size", "prompt tokens per chunk"),
        ("group_chunk_size", "prompt tokens per chunk of the group"),
        ("block_size", "tokens per KV page"),
        ("threads_per_process", "torch threads of each process"),
        ("cores", "CPU cores of the machine"),
        ("transport", "how hidden states go between stage processes"),
        ("dtype", "weights' and KV cache's dtype"),
        ("repeats", "times each way was timed (medians reported)"),
        (r"ttft_single_(\d+)_s", "seconds to the first token of a {0}-token prompt, one process"),
        (
            r"ttft_cpp(\d+)_(\d+)_s",
            "seconds to the first token of a {1}-token prompt over {0} stage processes",
        ),
        (r"cpp(\d+)_speedup_(\d+)", "one process over {0} stages, {1} tokens (goal >= 1.6 at 2)"),
        (
            r"cpp(\d+)_logits_rel_err_(\d+)",
            "{0} stages against one process, {1} tokens: max abs logit difference over "
            "max abs logit",
        ),
        (r"cpu_single_(\d+)_s", "CPU seconds of the one process, {0} tokens"),
        (r"cpu_cpp(\d+)_(\d+)_s", "CPU seconds of all {0} stages together, {1} tokens"),
        (
            r"cpu_cpp(\d+)_slowest_stage_(\d+)_s",
            "CPU seconds of the slowest of {0} stages, {1} tokens",
        ),
        ("skipped", "runs the model could not hold"),
        ("load_average_1m", "the machine's 1-minute load average when the run ended"),
    ],
    "cpp_cluster": [
        ("model", "the model served"),
        ("prompt_tokens", "tokens of each prompt"),
        ("stages", "stages of the prefill group"),
        ("chunk_size", "prompt tokens per chunk (every prefill instance)"),
        ("rounds", "prompts timed on each path (medians reported)"),
        ("cores", "CPU cores of the machine"),
        (r"ttft_single_(\d+)_s", "seconds to the first token of a {0}-token prompt, whole model"),
        (
            r"ttft_group(\d+)_(\d+)_s",
            "seconds to the first token of a {1}-token prompt on a group of {0} stages",
        ),
        (r"group(\d+)_speedup_(\d+)", "whole model over {0} stages, {1} tokens"),
        ("load_average_1m", "the machine's 1-minute load average when the run ended"),
    ],
    "piggyback": [
        ("model", "the model measured"),
        ("device", "the device"),
        ("dtype", "weights' and KV cache's dtype"),
        ("threads", "torch threads"),
        ("block_size", "tokens per KV page"),
        ("attention_backend", "the attention backend"),
        ("streams", "running decode streams"),
        ("stream_context_tokens", "context tokens of each running stream"),
        (
            r"ttft_separate_(\d+)_s",
            "median s to the first token of a {0}-token prompt, separate prefill",
        ),
        (
            r"ttft_piggyback_(\d+)_s",
            "median s to the first token of a {0}-token prompt, piggybacked",
        ),
        (r"piggyback_ttft_speedup_(\d+)", "separate over piggybacked TTFT, {0}-token prompts"),
        ("ttft_separate_s", "median s to the first token over every prompt, separate prefill"),
        ("ttft_piggyback_s", "median s to the first token over every prompt, piggybacked"),
        ("piggyback_ttft_speedup", "separate over piggybacked TTFT (goal >= 1.5)"),
        ("decode_step_median_s", "median s of a plain decode step of the running streams"),
        (
            "tbt_p99_without_s",
            "p99 s between the running streams' tokens, no prompt in their batch",
        ),
        ("tbt_p99_with_s", "p99 s between the running streams' tokens, prompts piggybacked"),
        ("tbt_slo_s", "the TBT SLO the chunks are bounded by (the gateway's default)"),
        ("piggyback_chunks_mean", "mean chunks a prompt took under `tbt_slo_s`"),
        ("step_fixed_s", "the learnt step-time model's fixed cost per step, s"),
        ("step_per_token_s", "the learnt step-time model's cost per token in the step, s"),
        ("tbt_slo_tight_s", "the tight TBT SLO: twice the run's median plain decode step"),
        ("ttft_piggyback_tight_s", "median s to the first token, piggybacked under the tight SLO"),
        ("tbt_p99_with_tight_s", "p99 s between the running streams' tokens under the tight SLO"),
        ("tbt_p99_plain_tight_s", "p99 s of the plain steps of the tight rounds"),
        ("tight_steps_within_slo", "share of the tight rounds' steps within the tight SLO"),
        ("piggyback_chunks_mean_tight", "mean chunks a prompt took under the tight SLO"),
    ],
    "sim_matrix": [
        ("wins", "settings the conductor wins on all three criteria"),
        ("settings", "settings in the matrix"),
        ("losses", "the settings lost, with the criteria missed (workload/profile/speed/shape)"),
        ("matrix_wall_s", "wall-clock seconds the matrix took"),
        ("limit", "requests per workload (0: every request)"),
        (
            r"dynamo_setting_(mooncake|dynamo_kv)_ttft_mean_s",
            "Dynamo's setting: mean TTFT of `{0}`, s",
        ),
        (
            r"dynamo_setting_(mooncake|dynamo_kv)_ttft_p90_s",
            "Dynamo's setting: p90 TTFT of `{0}`, s",
        ),
        (
            r"dynamo_setting_(mooncake|dynamo_kv)_hit_ratio",
            "Dynamo's setting: prefix hit ratio of `{0}` (Dynamo's own replay: 0.529)",
        ),
        (
            "simulated_seconds_per_wall_second",
            "simulated seconds per wall-clock second of the conductor's run in Dynamo's "
            "setting (goal >= 250)",
        ),
        ("seeds", "the seeds the matrix ran on (`--seeds`; the figures above are the first's)"),
        ("wins_by_seed", "settings the conductor wins on each of those seeds, in order"),
        ("settings_won_on_every_seed", "settings the conductor wins on every one of the seeds"),
        ("seeds_wall_s", "wall-clock seconds the matrices of every seed took, run side by side"),
    ],
    "families": [
        ("threads", "torch threads"),
        ("dtype", "weights' and KV cache's dtype of the timed models"),
        (r"(\w+?)_prefill_tokens_per_s", "{0}: prompt tokens/s of a 512-token prefill"),
        (
            r"(\w+?)_decode_tokens_per_s_batch_8",
            "{0}: tokens/s of one decode step over 8 sequences of 256 tokens",
        ),
        (
            r"(moe|dense)_decode_tokens_per_s_batch_(\d+)",
            "{0}: decode tokens/s at batch {1} (Qwen3-MoE, 16 experts of 512, 2 per token; "
            "or Qwen3 with one MLP of 1,024: the same active parameters)",
        ),
        (r"moe_vs_dense_batch_(\d+)", "MoE decode tokens/s over dense at batch {0}"),
        (r"(moe|dense)_layer_parameters", "{0}: parameters in its decoder layers (all experts)"),
        (
            r"(\w+?)_latent_kv_bytes_per_token",
            "{0}: KV bytes per token as the engine keeps it (one latent per layer, bfloat16)",
        ),
        (
            r"(\w+?)_per_head_kv_bytes_per_token",
            "{0}: KV bytes per token as per-head keys and values would be (bfloat16)",
        ),
        (r"(\w+?)_per_head_over_latent", "{0}: per-head K/V bytes over the latent's"),
        (r"(\w+?)_kv_bytes_per_token", "{0}: KV bytes one token keeps (every layer, float32)"),
        (r"(\w+?)_pool_tokens_per_gb_latent", "{0}: tokens a GB of KV pool holds as latents"),
        (r"(\w+?)_pool_tokens_per_gb_per_head", "{0}: tokens a GB holds as per-head K/V"),
    ],
    "prefix_overlap": [
        ("prompt_tokens", "prompt tokens"),
        ("cached_tokens", "prompt tokens whose KV is fetched from the kvstore"),
        ("prefix_mb", "MB of KV the prefix fetch moves"),
        ("load_s", "seconds to fetch the prefix alone"),
        ("compute_s", "seconds to compute the rest alone, the prefix in place"),
        ("load_then_compute_s", "seconds to fetch, then compute"),
        ("overlapped_s", "seconds with the compute running on the prefix as it lands"),
        ("overlapped_over_max", "overlapped over the longer of load and compute (goal <= 1.15)"),
        ("load_then_compute_over_max", "load then compute over the longer of the two"),
        ("overlap_speedup", "load-then-compute time over overlapped time"),
        ("rounds", "rounds the medians are of"),
        (r"ttft_reuse_s_(overlap|load_first)", "TTFT, prefix from the other host's kvstore ({0})"),
        (r"ttft_recompute_s_(overlap|load_first)", "TTFT computing the whole prompt ({0} run)"),
        (r"reused_tokens_(overlap|load_first)", "prompt tokens the reuse request fetched ({0})"),
    ],
    "kv_fp8": [
        ("prompts", "chat prompts of the accuracy run"),
        ("tokens_per_prompt", "positions compared per prompt"),
        ("greedy_match", "share of positions where the 8-bit cache's argmax is float32's token"),
        ("dlogprob_mean", "mean |difference| of the float32 token's log-probability"),
        ("dlogprob_max", "largest |difference| of the float32 token's log-probability"),
        ("free_run_identical", "share of prompts whose 8-bit greedy output is float32's"),
        ("ppl_text_tokens", "tokens of the perplexity text"),
        ("ppl_full", "perplexity of the text with float32 KV"),
        ("ppl_fp8", "perplexity of the text with 8-bit KV"),
        ("ppl_ratio", "8-bit perplexity over float32's"),
        (r"block_bytes_(full|fp8)", "bytes of one pool block ({0}: full = float32)"),
        (r"blocks_per_gib_(full|fp8)", "pool blocks a GiB holds ({0})"),
        ("blocks_per_gib_ratio", "8-bit blocks per GiB over float32's"),
        (r"transfer_2048_s_(full|fp8)", "seconds to move a 2,048-token prefix over UCX ({0})"),
        ("transfer_2048_speedup", "float32 transfer time over 8-bit's"),
        (r"ttft_reuse_s_(full|fp8)", "TTFT with a 2,048-token prefix from a remote kvstore ({0})"),
        (r"ttft_recompute_s_(full|fp8)", "TTFT computing the whole prompt ({0})"),
        (r"reused_tokens_(full|fp8)", "prompt tokens the reuse request fetched ({0})"),
    ],
    "tensor_parallel": [
        ("cores", "the machine's cores (every timed way uses all of them)"),
        ("dtype", "weights' and KV cache's dtype"),
        ("tokens", "prompt tokens of the timed prefill and of the transfers"),
        (
            r"(llama|smollm2)_logits_rel_diff",
            "{0}: largest difference of the instance's next-token logits from one "
            "process's, relative to the largest logit (the run fails above 1e-4 for the "
            "trained model; 30 random layers amplify rounding, so for `llama` it is only "
            "recorded)",
        ),
        (
            r"(llama|smollm2)_tp(\d+)_prefill_(\d+)_s",
            "{0}: seconds to prefill {2} tokens at TP={1}",
        ),
        (
            r"(llama|smollm2)_tp(\d+)_prefill_tokens_per_s",
            "{0}: prompt tokens/s at TP={1}",
        ),
        (
            r"(llama|smollm2)_tp(\d+)_decode_batch_8_tokens_per_s",
            "{0}: decode tokens/s at TP={1}, 8 sequences of 512 tokens",
        ),
        (
            r"(llama|smollm2)_tp(\d+)_over_tp1_prefill_speed",
            "{0}: prefill speed at TP={1} over one process's, same cores, same run",
        ),
        (
            r"(llama|smollm2)_tp(\d+)_over_tp1_decode_speed",
            "{0}: decode speed at TP={1} over one process's, same cores, same run",
        ),
        (
            r"(llama|mla)_p(\d+)_d(\d+)_bytes_per_token",
            "{0}, prefill TP={1} to decode TP={2}: KV bytes received per prompt token",
        ),
        (
            r"(llama|mla)_p(\d+)_d(\d+)_pieces_per_page",
            "{0}, TP={1} to TP={2}: pieces each (layer, page) travels in (runs of heads "
            "one rank holds on both sides)",
        ),
        (
            r"(llama|mla)_p(\d+)_d(\d+)_buffers",
            "{0}, TP={1} to TP={2}: pieces of the whole transfer",
        ),
        (
            r"(llama|mla)_p(\d+)_d(\d+)_s",
            "{0}, TP={1} to TP={2}: seconds from the first send to the commit (replicas copied)",
        ),
        (
            r"mla_p(\d+)_d(\d+)_bytes_per_token_if_sent_to_every_rank",
            "MLA, TP={0} to TP={1}: bytes per token were the latent sent to every decode rank",
        ),
    ],
    "hf_backend": [
        ("model", "the model measured"),
        ("device", "the device"),
        ("dtype", "weights' and KV cache's dtype"),
        ("threads", "torch threads"),
        ("block_size", "tokens per KV page"),
        ("chunk_size", "tokens per prefill chunk"),
        ("decode_context_tokens", "about how many tokens each decoding sequence holds"),
        ("decode_steps", "greedy decode steps per timed run"),
        ("repeats", "timed runs of each way (medians reported)"),
        ("attention_backend", "the attention backend both ways use"),
        ("transformers", "the transformers version whose modules `hf_modules` runs"),
        (
            r"logits_max_abs_diff_prefill_(\d+)",
            "largest absolute difference of the two ways' float32 logits after a {0}-token "
            "prefill (the run fails above 1e-4)",
        ),
        (
            r"logits_max_abs_diff_decode_batch_(\d+)",
            "the same after one decode step of {0} sequences of different lengths",
        ),
        ("kv_max_abs_diff_prefill", "largest absolute difference of the KV the two ways wrote"),
        (
            r"(runner|hf_modules)_prefill_tokens_per_s_(\d+)",
            "prompt tokens/s of `{0}` on a {1}-token prompt (chunked, KV written into pages)",
        ),
        (
            r"(runner|hf_modules)_decode_tokens_per_s_batch_(\d+)",
            "decode tokens/s of `{0}` with {1} sequences (greedy argmax)",
        ),
        (
            r"hf_modules_over_runner_prefill_(\d+)",
            "`hf_modules` prefill speed over `runner`'s, {0} tokens (median of the ratios of "
            "neighbouring runs)",
        ),
        (
            r"hf_modules_over_runner_decode_batch_(\d+)",
            "`hf_modules` decode speed over `runner`'s, {0} sequences (median of the ratios of "
            "neighbouring runs)",
        ),
    ],
    "engine": [
        ("model", "the model measured"),
        ("device", "the device the model ran on (`--device`)"),
        ("dtype", "weights' and KV cache's dtype"),
        ("threads", "torch threads"),
        ("block_size", "tokens per KV page"),
        ("chunk_size", "tokens per prefill chunk"),
        ("decode_context_tokens", "tokens already in each sequence when decode is timed"),
        ("attention_backend", "the attention path the runner picked"),
        (
            r"prefill_tokens_per_s_(\d+)",
            "prompt tokens/s of `ModelRunner.prefill` on a {0}-token prompt, KV written into pages",
        ),
        (
            r"reference_prefill_tokens_per_s_(\d+)",
            "prompt tokens/s of transformers' forward on the same {0} tokens (SDPA, "
            "`logits_to_keep=1`, its KV cache on)",
        ),
        (r"prefill_vs_reference_(\d+)", "our prefill speed over transformers', {0} tokens"),
        (
            r"decode_tokens_per_s_batch_(\d+)",
            "tokens/s of `DecodeBatcher.step` with {0} sequences (greedy sampling and "
            "detokenization included)",
        ),
        (r"decode_batch_(\d+)_vs_1", "decode tokens/s at batch {0} over batch 1"),
        ("ttft_full_4096_s", "seconds to prefill a 4,096-token prompt from nothing"),
        (
            "ttft_reuse_3584_of_4096_s",
            "seconds to prefill the same prompt with its first 3,584 tokens' KV in the pages",
        ),
        ("prefix_reuse_ttft_speedup", "`ttft_full_4096_s` over `ttft_reuse_3584_of_4096_s`"),
    ],
    "transfer": [
        (r"ucx_gbps_(\d+)mb", "GB/s of one {0} MiB transfer, every page its own allocation"),
        (r"ucx_gbps_(\d+)mb_best", "the fastest of those {0} MiB transfers"),
        (
            r"ucx_gbps_(\d+)mb_contiguous",
            "GB/s of one {0} MiB transfer, pages adjacent in one array (sent as runs of up "
            "to 8 MiB)",
        ),
        (r"ucx_gbps_(\d+)mb_contiguous_best", "the fastest of those adjacent-page transfers"),
        (r"memcpy_gbps_(\d+)mb", "GB/s of `numpy.copyto` of {0} MiB, same run"),
        (r"memcpy_gbps_(\d+)mb_best", "the fastest of those copies"),
        (r"xxh3_gbps_(\d+)mb", "GB/s of one xxh3 checksum pass over {0} MiB"),
        (
            r"sender_cpu_s_per_gb_(\d+)mb(_contiguous)?",
            "sender's CPU seconds per GB moved, {0} MiB payloads",
        ),
        (
            r"receiver_cpu_s_per_gb_(\d+)mb(_contiguous)?",
            "receiver's CPU seconds per GB moved, {0} MiB payloads",
        ),
        (
            r"ucx_perftest_gbps_(\w+)_messages",
            "UCX's own C benchmark (`ucx_perftest -t tag_bw`), one {0} buffer resent, same "
            "UCX settings, no checksums",
        ),
    ],
    "containers_transfer": [
        (
            r"(host|tcp|cma)_rendezvous_transport",
            "the UCX lane that carried large messages ({0}), as UCX_PROTO_INFO reported it",
        ),
        (
            r"(host|tcp|cma)_ucx_gbps_(\d+)mb",
            "{0}: GB/s of one {1} MiB transfer, every page its own allocation",
        ),
        (
            r"(host|tcp|cma)_ucx_gbps_(\d+)mb_contiguous",
            "{0}: GB/s of one {1} MiB transfer, pages adjacent in one array",
        ),
        (r"(host|tcp|cma)_memcpy_gbps_(\d+)mb", "{0}: GB/s of `numpy.copyto` of {1} MiB"),
        (
            r"(host|tcp|cma)_over_memcpy_(\d+)mb",
            "{0}: UCX transfer over memcpy, {1} MiB, same run",
        ),
        (
            r"(host|tcp|cma)_sender_cpu_s_per_gb_(\d+)mb(_contiguous)?",
            "{0}: sender's CPU seconds per GB moved, {1} MiB payloads",
        ),
    ],
    "conductor": [
        (
            "decision_latency_p50_ms",
            "median ms per admission decision (fold, Algorithm 1 over the instances that can "
            "win (docs/scheduling.md; pools of up to 64 prefill or 48 decode instances "
            "whole), decode prediction, admission, explanation)",
        ),
        ("decision_latency_p99_ms", "99th percentile of the same"),
        ("decisions_per_s", "admissions decided per second of time spent deciding"),
        (
            "replay_events_per_s",
            "events/s of a verifying replay of the whole log, every decision recomputed and "
            "compared (decoded events in memory; reading from NATS excluded)",
        ),
        ("full_scan", "whether the planners evaluated every instance (`--full-scan`)"),
        (
            "full_scan_decision_latency_p50_ms",
            "with `--compare`: the median with every instance evaluated (Algorithm 1 as "
            "written), same log, same run",
        ),
        ("full_scan_decision_latency_p99_ms", "the 99th percentile of the same"),
        ("full_scan_decisions_per_s", "decisions per second with every instance evaluated"),
        ("full_scan_replay_events_per_s", "replay events/s with every instance evaluated"),
        ("prefill_instances", "simulated prefill instances (each with a kvstore)"),
        ("decode_instances", "simulated decode instances"),
        ("log_events", "events in the log"),
        ("decisions", "admissions in the log"),
        ("index_blocks", "blocks in the conductor's index at the end"),
        ("against", "with `--against REV`: the git revision timed in turn with this code"),
        (
            r"against_(decision_latency_p50_ms|decision_latency_p99_ms|decisions_per_s|"
            r"replay_events_per_s|decisions)",
            "{0} of the code at `against`, on its own log of the same trace, in the same run "
            "(a round of each in turn)",
        ),
        (
            "decisions_per_s_over_against",
            "this code's decisions per second over the `against` revision's, same run",
        ),
        (
            "over_against_lowest_round",
            "the lowest ratio of one round's pair (this code's round over the `against` "
            "revision's round just before it): the noise of the median ratio",
        ),
        ("over_against_highest_round", "the highest ratio of one round's pair"),
    ],
    "timeline": [
        ("requests", "requests in the report"),
        ("log_events", "events in the simulation log"),
        ("lanes", "instance lanes (prefill, decode, kvstore)"),
        ("report_mb", "size of the HTML file, MB"),
        ("build_s", "seconds to build the report from the decoded log"),
        (
            "open_ms_median",
            "median ms from navigation start to the page's ready mark (data parsed, every lane "
            "drawn, two frames later); the goal is under 2,000",
        ),
        ("open_ms_max", "slowest of the same"),
        (
            "decision_ms_median",
            "median ms from a click on a request's bar to its decision in the panel, right "
            "after the ready mark",
        ),
    ],
    "grammar": [
        ("model", "the model and its cached conversion"),
        ("device", "where it ran"),
        ("dtype", "the weights' and activations' type"),
        ("threads", "torch threads"),
        ("grammar", "the grammar the constrained runs follow"),
        ("prompt_tokens", "tokens of the prompt"),
        ("steps", "decode steps per run"),
        (
            r"step_ms_batch_(\d+)_unconstrained",
            "median ms of one decode step, batch {0}, no grammar",
        ),
        (
            r"step_ms_batch_(\d+)_grammar",
            "median ms of one decode step, batch {0}, every row held to the grammar",
        ),
        (
            r"grammar_step_overhead_pct_batch_(\d+)",
            "how much longer the constrained step is, batch {0}, %",
        ),
        (
            r"mask_us_per_token_batch_(\d+)",
            "median µs to build and apply one sequence's token mask (llguidance's bitmask, "
            "unpacked, applied to its logits row), batch {0}",
        ),
    ],
    "overhead": [
        (
            r"latency_p50_ms_c(\d+)",
            "median ms from sending a request to the end of its SSE stream, {0} in flight",
        ),
        (r"latency_p99_ms_c(\d+)", "99th percentile of the same, {0} in flight"),
        ("rounds", "rounds of each loaded run (16 and 64 in flight)"),
        (
            r"requests_per_s_c(\d+)_round_min",
            "requests/s of the slowest round, {0} in flight",
        ),
        (
            r"requests_per_s_c(\d+)_round_max",
            "requests/s of the fastest round, {0} in flight",
        ),
        (
            r"requests_per_s_c(\d+)",
            "requests answered per second, {0} in flight (every round together)",
        ),
        (r"requests_c(\d+)", "requests sent with {0} in flight (every round)"),
        (
            r"errors_c(\d+)",
            "requests that failed with {0} in flight (non-200, error event, no [DONE])",
        ),
        (
            r"cpu_ms_per_request_total_c(\d+)",
            "CPU ms (user+system) the whole cluster spent per request answered, {0} in "
            "flight (the client left out)",
        ),
        (
            r"cpu_ms_per_request_client_c(\d+)",
            "CPU ms the benchmark's own HTTP client spent per request, {0} in flight",
        ),
        (
            r"cpu_ms_per_request_(\w+?)_c(\d+)",
            "CPU ms (user+system) {0} spent per request answered, {1} in flight",
        ),
        (
            "idle_cpu_ms_per_s_total",
            "CPU ms (user+system) the whole cluster spent a second while serving nothing",
        ),
        (r"idle_cpu_ms_per_s_(\w+)", "CPU ms (user+system) {0} spent a second while idle"),
        ("traced_requests_c1", "one-at-a-time requests whose whole trace arrived"),
        (
            "traced_latency_p50_ms_c1",
            "median ms one at a time through the second `yb up`, whose services export every span",
        ),
        ("traced_latency_p99_ms_c1", "99th percentile of the same"),
        (
            "hop_ms_outside_gateway_p50",
            "median ms of client latency outside the gateway's span: HTTP, parsing before "
            "the span opens, and the Python client itself",
        ),
        ("hop_ms_gateway_total_p50", "median ms of the gateway's root span; the hops add up to it"),
        (
            "hop_ms_unattributed_p50",
            "median ms of the gateway's span that no hop covers",
        ),
        (
            r"hop_ms_(\w+)_p50",
            "median ms of the hop `{0}`, one request at a time (the gap between the spans "
            "around it, or a span itself; benchmarks/overhead.py's PATH)",
        ),
        (r"span_ms_(\w+)_p50", "median ms of the span `{0}` itself, one request at a time"),
    ],
    "e2e_chat": [
        ("ttft_cold_s", "seconds to the first token of the first request"),
        ("ttft_warm_median_s", "median seconds to the first token of the later requests"),
        ("decode_tokens_per_s_median", "median decode tokens/s of the later requests"),
        ("completion_tokens", "tokens the first request produced"),
        ("answer_names_paris", 'whether every answer contained "Paris"'),
        *MEMORY_FIGURES,
        (r"kv_pages_(\w+)", "KV pages {0} sized for itself (its `kv_cache_sized` log line)"),
    ],
    "elastic_live": [
        ("model", "the model served"),
        ("max_instances", "`--max-instances`: engine processes at most"),
        (r"(low|high)_rate", "requests a second sent in the {0} phase"),
        ("high_s", "seconds the high rate lasts"),
        ("ttft_slo_s", "the TTFT SLO every request asked for, seconds"),
        (
            "first_add_s",
            "seconds from the step to the first `PoolPlanned` that adds (or moves) an instance",
        ),
        ("first_add_role", "the pool that first add grew"),
        (
            "first_new_up_s",
            "seconds from the step to the first `InstanceUp` of an engine not up before",
        ),
        ("first_new_instance", "that engine"),
        ("instances_at_step", "engines serving at the last planner decision before the step"),
        ("instances_peak", "the most engines serving at one planner decision"),
        (
            r"requests_(before|during|during_grown|after)",
            "requests sent in the phase `{0}` (`during_grown`: in the high rate, after "
            "the first new engine was up)",
        ),
        (
            r"ttft_(p50|p90)_s_(before|during|during_grown|after)",
            "{0} time to first token, s, of the requests sent in the phase `{1}`, as the "
            "client measured it",
        ),
        (
            r"ttft_within_slo_(before|during|during_grown|after)",
            "share of the phase `{0}`'s completed requests within the TTFT SLO",
        ),
        ("requests_sent", "requests sent"),
        ("requests_ok", "requests completed (200, a whole stream, `[DONE]`)"),
        ("requests_failed", "requests that failed, refused or timed out"),
        ("failed_kinds", "how those ended (empty: none)"),
        ("drains_decided", "drain and move actions the planner decided after the load fell"),
        ("first_drain_s", "seconds from the fall to the first of them"),
        ("drained", "the instances drained"),
        (
            r"drain_to_down_s_(max|mean)",
            "{0} seconds from a drained instance's `InstanceDraining` to its `InstanceDown`",
        ),
        ("drained_all_down", "whether every drained instance was down before the deadline"),
        ("instances_at_end", "engines serving at the planner's last decision"),
        ("run_wall_s", "seconds the whole benchmark took"),
    ],
    "batch_live": [
        ("model", "the model served"),
        ("lines", "lines in the batch (`--lines`)"),
        ("batch_max_tokens", "`max_tokens` of every batch line"),
        ("requests_per_phase", "interactive requests sent in each phase"),
        ("rate", "interactive requests a second (Poisson arrivals, the same in each phase)"),
        ("prompt_tokens", "tokens per interactive prompt (none shared)"),
        ("output_tokens", "tokens each interactive request asks for"),
        ("ttft_slo_s", "the gateway's TTFT SLO, seconds"),
        ("tbt_slo_s", "the gateway's TBT SLO, seconds"),
        (
            r"ttft_(p50|p90)_s_(alone|with_batch|after)",
            "{0} time to first token, s, of the interactive requests of the phase `{1}`, as "
            "the client measured it",
        ),
        (
            r"tbt_p90_s_(alone|with_batch|after)",
            "90th percentile of every gap between streamed tokens, s, in the phase `{0}`",
        ),
        (
            r"goodput_(alone|with_batch|after)",
            "share of the phase `{0}`'s requests completed within both SLOs (TBT at each "
            "request's 90th percentile gap)",
        ),
        (r"requests_ok_(alone|with_batch|after)", "requests of the phase `{0}` completed"),
        (
            r"requests_failed_(alone|with_batch|after)",
            "requests of the phase `{0}` that failed, refused or timed out",
        ),
        (r"failed_kinds_(alone|with_batch|after)", "how those ended (empty: none)"),
        (
            r"load_average_1m_(alone|with_batch|after)",
            "the machine's 1-minute load average when the phase `{0}` started",
        ),
        ("ttft_p90_ratio", "`ttft_p90_s_with_batch` over `ttft_p90_s_alone`"),
        ("batch_status", "the batch's status at the end"),
        (
            "batch_completion_s",
            "seconds from `batches.create` to the first `batches.retrieve` that saw "
            "`completed` (polled every 0.5 s)",
        ),
        ("batch_lines_per_s", "lines over `batch_completion_s`"),
        (r"batch_counts_(total|completed|failed)", "the batch's `request_counts.{0}`"),
        (
            "batch_completed_during_load",
            "lines done when the last interactive request beside the batch ended",
        ),
        (
            "batch_outlived_load",
            "whether the batch was still running then (so all of `with_batch` ran beside it)",
        ),
        ("output_lines", "lines in the output file"),
        ("output_custom_ids", "distinct `custom_id`s in the output file"),
        ("output_duplicates", "output lines beyond the first for a `custom_id`"),
        ("output_not_200", "output lines without a 200 response, or with an error"),
        ("missing_custom_ids", "lines in neither the output nor the error file"),
        ("error_lines", "lines in the error file"),
        ("error_codes", "their error codes, with counts (empty: none)"),
        (
            "answered_exactly_once",
            "every line in the output file exactly once, answered 200; none in the error file",
        ),
        ("batch_completion_tokens_mean", "mean `completion_tokens` of the batch's answers"),
        ("batch_admissions", "batch lines the gateway sent to the conductor, every try"),
        (
            "batch_held",
            "of them, refused `batch_held` (interactive traffic used the capacity; tried "
            "again with a back-off)",
        ),
        ("batch_held_during_load", "of those, while the interactive load beside it ran"),
        ("batch_other_rejections", "batch tries refused for any other reason"),
        ("batch_runs", "batch tries scheduled (more than the lines: a line ran twice)"),
        ("batch_runs_during_load", "of them, while the interactive load beside it ran"),
        ("interactive_rejected", "interactive requests the conductor refused"),
        ("run_wall_s", "seconds the whole benchmark took"),
    ],
    "e2e_reuse": [
        ("ttft_recompute_s", "median seconds to the first token, every token computed"),
        (
            "ttft_reuse_s",
            "median seconds to the first token, the prefix fetched from the other host's "
            "kvstore and only the rest computed",
        ),
        ("ttft_speedup", "`ttft_recompute_s` over `ttft_reuse_s`"),
        ("prompt_tokens", "tokens per prompt"),
        ("reused_tokens", "median tokens the reusing prefill did not compute"),
        ("rounds", "rounds measured"),
        *MEMORY_FIGURES,
    ],
    "overload": [
        ("model", "the model served"),
        ("ttft_alone_s", "median seconds to the first token of one request alone"),
        (
            "capacity_requests",
            "naive capacity: prefill instances x floor(TTFT SLO / `ttft_alone_s`)",
        ),
        ("burst_requests", "requests sent at one instant: `--factor` x capacity"),
        ("burst_wall_s", "seconds until every request of the first burst had ended"),
        ("accepted", "requests answered 200"),
        ("rejected_429", "requests refused with 429"),
        ("other_errors", "requests that ended any other way"),
        ("other_error_kinds", "how those ended"),
        ("rejected_with_retry_after", "refusals that carried `Retry-After`"),
        (r"retry_after_(min|max)_s", "{0} `Retry-After` given, seconds"),
        (r"reject_answer_(p50|p99|max)_s", "{0} seconds from sending to a refusal's status line"),
        (r"accepted_ttft_(p50|p99)_s", "{0} time to first token of accepted requests, seconds"),
        (
            r"accepted_tbt_p90_(p50|p99)_s",
            "{0} over accepted requests of each one's 90th-percentile gap between tokens, s",
        ),
        ("accepted_within_slo", "accepted requests within both SLOs"),
        ("accepted_slo_attainment", "fraction of accepted requests within both SLOs"),
        ("ttft_slo_s", "the TTFT SLO every request asked for, seconds"),
        ("tbt_slo_s", "the time-between-tokens SLO every request asked for, seconds"),
        (
            r"memory_mb_(\w+?)_(before|peak|after)",
            "resident memory of every {0} process summed, MB, {1} the bursts",
        ),
        ("processes_dead", "processes of the cluster that died (empty: none)"),
        ("serves_after", "whether the cluster served a request after the bursts"),
        ("later_bursts", "empty: one burst was sent"),
        (
            r"later_bursts_(\d+)_(\w+)",
            "`{1}` of burst {0} after the first, sent once the one before had drained",
        ),
    ],
    "compose": [
        ("compose", "the compose command"),
        ("cold", "whether the project's images and the build cache were removed first"),
        (
            "up_to_ready_cold_s",
            "seconds from `up -d --build` until every service was healthy, building every "
            "image (torch from a local wheel, the rest from PyPI)",
        ),
        (
            "up_to_ready_warm_s",
            "the same with the images and the build cache in place (volumes removed: the "
            "model is converted again)",
        ),
        ("first_chat_ttft_s", "seconds to the first text of the first streamed chat"),
        ("first_chat_total_s", "seconds to the end of that chat (up to 32 tokens)"),
        (r"memory_mb_idle_([\w-]+)", "memory of {0}'s container at idle, MB (`docker stats`)"),
        (
            r"memory_mb_load_peak_([\w-]+)",
            "highest memory of {0}'s container sampled under the bench load, MB",
        ),
        (r"load_requests_(ok|failed)", "bench requests that ended {0}"),
        ("load_duration_s", "seconds the bench load took"),
        (r"image_mb_(\w+)", "size of the {0} image, MB"),
    ],
}


#: Benchmarks that measure further cluster shapes in one run (`--shapes`): a figure
#: suffixed `_<prefill>x<decode>` means what the unsuffixed one means, at that shape.
SHAPED: Final = frozenset({"conductor"})


def describe(benchmark: str, key: str) -> str:
    """The meaning of `key` in `benchmark`'s figures; KeyError names an undescribed one."""
    for pattern, meaning in DESCRIPTIONS.get(benchmark, []):
        match = re.fullmatch(pattern, key)
        if match:
            return meaning.format(*(g or "" for g in match.groups()))
    shaped = re.fullmatch(r"(\w+?)_(\d+)x(\d+)", key) if benchmark in SHAPED else None
    if shaped:
        base, prefill, decode = shaped.groups()
        return f"{describe(benchmark, base)}; at {prefill} prefill + {decode} decode"
    raise KeyError(f"{benchmark}: no description for figure {key!r} (add it in {__file__})")


def shown(value: Figure) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if value != 0 and abs(value) < 0.01:
            return f"{value:.2g}"
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:,.3g}"
    if isinstance(value, int):
        return f"{value:,}"
    if value is None:
        return "–"
    return f"`{value}`" if value else "(none)"


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def where_and_when(machine: Machine, provenance: Provenance) -> str:
    tree = " with uncommitted changes" if provenance.tree_dirty else ""
    when = provenance.measured_at.strftime("%Y-%m-%d %H:%M UTC")
    return f"Measured {when} at commit `{provenance.commit[:10]}`{tree}, on {machine.summary()}."


def benchmark_section(record: BenchmarkRecord) -> list[str]:
    if record.name not in SUMMARIES:
        raise KeyError(f"no summary for benchmark {record.name!r} (add it in {__file__})")
    lines = [
        f"## {record.name}",
        "",
        SUMMARIES[record.name],
        "",
        where_and_when(record.machine, record.provenance)
        + f" Load average {record.load_average_1m:g} when it started; the run took "
        f"{record.duration_s:,.0f} s.",
        "",
        "```",
        record.command,
        "```",
        "",
        "| figure | value | meaning |",
        "|---|---|---|",
    ]
    for key, value in record.figures.items():
        lines.append(f"| `{key}` | {cell(shown(value))} | {cell(describe(record.name, key))} |")
    return [*lines, ""]


def stability_section(record: StabilityRecord) -> list[str]:
    report = record.report
    suites = [r.seconds / 60 for r in report.runs if r.what == "whole suite"]
    passed = sum(r.exit == 0 for r in report.runs)
    lines = [
        "## stability",
        "",
        "The whole suite on a clean clone, back to back, then the fault and multi-host "
        "modules beside a CPU hog (`.ci/stability.py`). Its own machine line: "
        f"`{report.machine}`; Docker engine running: {shown(report.docker_engine_running)}.",
        "",
        where_and_when(record.machine, record.provenance),
        "",
        "```",
        record.command,
        "```",
        "",
        f"{passed} of {len(report.runs)} runs passed."
        + (f" Whole suite: median {statistics.median(suites):.1f} min." if suites else ""),
        "",
        "| run | what | beside | exit | counts | minutes |",
        "|---|---|---|---|---|---|",
    ]
    for run in report.runs:
        counts = ", ".join(f"{n} {kind}" for kind, n in run.counts.items())
        lines.append(
            f"| {run.run} | {cell(run.what)} | {cell(run.beside or '–')} | {run.exit} | "
            f"{counts} | {run.seconds / 60:.1f} |"
        )
    for run in report.runs:
        lines += [f"- {run.run}: `{cell(line)}`" for line in run.failures]
    return [*lines, ""]


def faults_section(record: FaultTableRecord) -> list[str]:
    lines = [
        "## faults",
        "",
        "What each fault test broke, what the client saw, what was cleaned up and how long "
        "recovery took (each row written by `yb_testkit.faults.record`).",
        "",
        where_and_when(record.machine, record.provenance),
        "",
        "```",
        record.command,
        "```",
        "",
        "| fault | caused by | client saw | cleaned up | checked by | recovery (s) |",
        "|---|---|---|---|---|---|",
    ]
    for row in record.rows.values():
        cells = (row.fault, row.caused_by, row.client_saw, row.cleaned_up, row.checked_by)
        lines.append("| " + " | ".join(cell(c) for c in cells) + f" | {row.recovery_s:.2f} |")
    return [*lines, ""]


def section_order(record: ResultsFile) -> int:
    order = [*BENCHMARKS, "stability", "faults"]
    return order.index(record.name) if record.name in order else len(order)


def render(records: Sequence[ResultsFile]) -> str:
    """The page for `records` (comparisons are skipped). Raises KeyError for a
    benchmark or figure this module does not describe."""
    shown_records = sorted(
        (r for r in records if not isinstance(r, ComparisonRecord)), key=section_order
    )
    lines = [
        "# Measurements",
        "",
        "<!-- Generated by `python benchmarks/measurements.py` from benchmarks/results/*.json;",
        "     edit those (benchmarks/record.py writes them), not this page. -->",
        "",
        "Every figure Yuebing reports, with the machine, the commit and the time it was "
        "measured and the command that measures it again. A benchmark is run and kept with "
        "`python benchmarks/record.py NAME [-- ARGS]`; this page is rendered from what it "
        "keeps. Where the machine was shared, the load average at the start says so: absolute "
        "numbers move with it, ratios measured in one run much less. The 2-core AMD EPYC "
        "machine (the rows below that name it) also changes speed by up to about 2x from one "
        "minute to the next with nothing else running, unseen from inside (no steal time): "
        "the overhead benchmark gave 154 and 365 requests/s on the same request path, and a "
        "fixed pure-Python loop took 1.07 s and 2.17 s of CPU two minutes apart. One run's "
        "absolute figures there carry that.",
        "",
        "| section | measured (UTC) | machine |",
        "|---|---|---|",
    ]
    for record in shown_records:
        assert not isinstance(record, ComparisonRecord)
        when = record.provenance.measured_at.strftime("%Y-%m-%d %H:%M")
        m = record.machine
        lines.append(
            f"| [{record.name}](#{record.name}) | {when} | "
            f"{m.cpu}, {m.cores} cores, {m.memory_gib:.0f} GiB, GPU: {m.gpu} |"
        )
    lines.append("")
    for record in shown_records:
        match record:
            case BenchmarkRecord():
                lines += benchmark_section(record)
            case StabilityRecord():
                lines += stability_section(record)
            case FaultTableRecord():
                lines += faults_section(record)
    return "\n".join(lines).rstrip("\n") + "\n"


def read_all(results_dir: Path) -> list[ResultsFile]:
    """Every results file in `results_dir`, checked against its struct and its name."""
    records = []
    for path in sorted(results_dir.glob("*.json")):
        record = read(path)
        if record.name != path.stem:
            raise ValueError(f"{path} holds the record of {record.name!r}")
        records.append(record)
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the page is stale")
    parser.add_argument("--results", type=Path, default=RESULTS_DIR)
    parser.add_argument("--page", type=Path, default=PAGE)
    options = parser.parse_args(argv)
    page = render(read_all(options.results))
    if not options.check:
        options.page.parent.mkdir(parents=True, exist_ok=True)
        options.page.write_text(page)
        print(f"written {options.page}")
        return 0
    current = options.page.read_text() if options.page.exists() else ""
    if current == page:
        return 0
    diff = difflib.unified_diff(
        current.splitlines(), page.splitlines(), str(options.page), "fresh render", lineterm=""
    )
    print("\n".join(diff), file=sys.stderr)
    print(
        f"{options.page} differs from {options.results}/*.json: "
        "run python benchmarks/measurements.py",
        file=sys.stderr,
    )
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
