"""lm-evaluation-harness against a whole cluster (`yb up`) gives the scores it gives on
the same weights through transformers.

lm-eval scores a model by log-likelihoods: its `local-completions` backend sends each
context plus continuation as token ids to `/v1/completions` with `echo: true,
logprobs: 1, max_tokens: 1` (several prompts a request here, `batch_size`), and reads
the prompt's own logprobs back (`choices[i].logprobs.token_logprobs[ctxlen:-1]`, its
greedy check from `top_logprobs`). Its `hf` backend computes them with transformers,
in this process's CPU float32. Three small tasks of this test's own, defined as local
YAML over local JSONL (nothing is downloaded: the hub is off), cover what harnesses
score with: multiple choice (`acc`, `acc_norm`), a continuation's likelihood and
greedy match (`perplexity`, `acc`), and a document's rolling likelihood
(`word_perplexity`, `byte_perplexity`, `bits_per_byte`). Each score must be equal to
1e-3 through both (a perplexity's logarithm, the mean log-likelihood it is the
exponential of: a random model's perplexity is 1e18).

`MODELS` lists what runs: a `yb up --model` source each (the default model, and a tiny
random DeepSeek-V3 checkpoint, MLA and experts); the `hf` backend reads the same
weights from the directory it resolves to (`hf_model_dir`). A model is one more entry
there.

Also here, through the same cluster: the prompt's logprobs of one request equal what
the engine computes directly (`ModelRunner.prefill(all_logits=True)`, 1e-5), the first
`null`, and equal again when the prompt's prefix is cached in the pool (sent twice):
that request computes its whole prompt, which its usage (`cached_tokens` 0) and the
prefill's counter show.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from yb_core.config import ModelConfig
from yb_core.model_files import default_model_cache_dir
from yb_testkit.fixtures import LocalCluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900, func_only=True)]

#: The model the cluster serves under this name (`yb up --model-name`).
SERVED = "under-test"
#: `yb up --model` sources scored through both backends.
MODELS = [
    pytest.param("default", id="smollm2-135m"),
    # DeepSeek-V3's latent attention and experts: a tiny random checkpoint
    # (`yb_testkit.checkpoints`), built into the test's directory.
    pytest.param("checkpoint:deepseek_v3", id="tiny-deepseek-v3"),
]
#: How close every score must be through the two backends.
TOLERANCE = 1e-3


def hf_model_dir(source: str) -> Path:
    """The Hugging Face directory `yb up --model source` serves (the default model's
    converted one, made once and cached)."""
    from yb_engine.models import resolve_model_dir

    path = resolve_model_dir(ModelConfig(source=source), default_model_cache_dir())
    assert path is not None, f"{source} has no directory"
    return path


# --- the tasks ----------------------------------------------------------------------

_QUESTIONS = [
    ("What is the capital of France?", ["Paris", "London", "Rome", "Berlin"], 0),
    ("How many legs does a spider have?", ["Six", "Eight", "Ten", "Four"], 1),
    ("What colour is the sky on a clear day?", ["Green", "Red", "Blue", "Black"], 2),
    ("Which animal says moo?", ["A dog", "A cat", "A duck", "A cow"], 3),
    ("What is two plus two?", ["Four", "Five", "Three", "Seven"], 0),
    ("Which is the largest planet?", ["Mars", "Jupiter", "Venus", "Earth"], 1),
]
_ENDINGS = [
    ("The cat sat on the", " mat"),
    ("Once upon a", " time"),
    ("The capital of Italy is", " Rome"),
    ("Water boils at one hundred degrees", " Celsius"),
]
_DOCUMENTS = [
    "The quick brown fox jumps over the lazy dog. It was a sunny day in the park.",
    "Paris is the capital and most populous city of France, on the river Seine.",
    "A language model assigns probabilities to sequences of words, one token at a time.",
]


def write_tasks(directory: Path) -> list[str]:
    """Three tiny lm-eval tasks as YAML over JSONL files in `directory`; their names."""
    directory.mkdir(parents=True, exist_ok=True)

    def data(name: str, rows: list[dict[str, Any]]) -> str:
        path = directory / f"{name}.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        return str(path)

    choice = data(
        "choice",
        [{"question": q, "choices": c, "answer": a} for q, c, a in _QUESTIONS],
    )
    ending = data("ending", [{"context": c, "ending": e} for c, e in _ENDINGS])
    document = data("document", [{"text": t} for t in _DOCUMENTS])

    def task(name: str, files: str, body: str) -> None:
        head = f"""\
            task: {name}
            dataset_path: json
            dataset_kwargs:
              data_files:
                test: {files}
            test_split: test
            """
        (directory / f"{name}.yaml").write_text(textwrap.dedent(head) + textwrap.dedent(body))

    task(
        "yb_choice",
        choice,
        """\
        output_type: multiple_choice
        doc_to_text: "Question: {{question}}\\nAnswer:"
        doc_to_choice: "{{choices}}"
        doc_to_target: answer
        target_delimiter: " "
        metric_list:
          - metric: acc
          - metric: acc_norm
        """,
    )
    task(
        "yb_ending",
        ending,
        """\
        output_type: loglikelihood
        doc_to_text: "{{context}}"
        doc_to_target: "{{ending}}"
        target_delimiter: ""
        metric_list:
          - metric: perplexity
            aggregation: perplexity
            higher_is_better: false
          - metric: acc
            aggregation: mean
            higher_is_better: true
        """,
    )
    task(
        "yb_document",
        document,
        """\
        output_type: loglikelihood_rolling
        doc_to_text: ""
        doc_to_target: "{{text}}"
        metric_list:
          - metric: word_perplexity
          - metric: byte_perplexity
          - metric: bits_per_byte
        """,
    )
    return ["yb_choice", "yb_ending", "yb_document"]


# --- running lm-eval ------------------------------------------------------------------

_RUN = """
import json, sys
import lm_eval
from lm_eval.tasks import TaskManager

args = json.loads(sys.argv[1])
results = lm_eval.simple_evaluate(
    model=args["model"],
    model_args=args["model_args"],
    tasks=args["tasks"],
    task_manager=TaskManager(include_path=args["include_path"]),
    batch_size=args["batch_size"],
    random_seed=0,
    numpy_random_seed=0,
    torch_random_seed=0,
    fewshot_random_seed=0,
)
scores = {
    task: {
        key.split(",")[0]: value
        for key, value in metrics.items()
        if "," in key and "stderr" not in key and isinstance(value, (int, float))
    }
    for task, metrics in results["results"].items()
}
print("SCORES " + json.dumps(scores))
"""


def lm_eval_scores(
    model: str,
    model_args: dict[str, Any],
    tasks_dir: Path,
    tasks: list[str],
    *,
    batch_size: int = 1,
    env: dict[str, str] | None = None,
) -> dict[str, dict[str, float]]:
    """Run lm-eval (`model`: its backend) on `tasks` in a process of its own, offline:
    the scores by task and metric."""
    run_env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(tasks_dir / "datasets-cache"),
        "TOKENIZERS_PARALLELISM": "false",
        "NO_PROXY": "*",
        **(env or {}),
    }
    args = {
        "model": model,
        "model_args": model_args,
        "tasks": tasks,
        "include_path": str(tasks_dir),
        "batch_size": batch_size,
    }
    done = subprocess.run(
        [sys.executable, "-c", _RUN, json.dumps(args)],
        capture_output=True,
        text=True,
        env=run_env,
        timeout=600,
        check=False,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("SCORES ")]
    assert done.returncode == 0 and lines, f"lm-eval {model} failed:\n{done.stderr[-6000:]}"
    scores: dict[str, dict[str, float]] = json.loads(lines[-1].removeprefix("SCORES "))
    return scores


def scores_through_both(
    model_dir: Path, url: str, api_key: str, work: Path
) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float]]]:
    """The tasks' scores through `local-completions` against the gateway at `url`
    (serving `model_dir` as `SERVED`) and through `hf` on `model_dir` itself."""
    tasks = write_tasks(work / "tasks")
    served = lm_eval_scores(
        "local-completions",
        {
            "model": SERVED,
            "base_url": f"{url}/v1/completions",
            "tokenizer": str(model_dir),
            "tokenizer_backend": "huggingface",
            "tokenized_requests": True,
            "add_bos_token": False,
            "max_length": 2048,
            "max_retries": 1,
            "timeout": 300,
        },
        work / "tasks",
        tasks,
        batch_size=4,  # four prompts a request: `prompt` as a list of token-id lists
        env={"OPENAI_API_KEY": api_key},
    )
    reference = lm_eval_scores(
        "hf",
        {
            "pretrained": str(model_dir),
            "dtype": "float32",
            "device": "cpu",
            "add_bos_token": False,
            "max_length": 2048,
        },
        work / "tasks",
        tasks,
    )
    return served, reference


# --- the cluster ----------------------------------------------------------------------


@pytest.fixture(scope="module", params=MODELS)
def cluster(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, LocalCluster]]:
    source: str = request.param
    root = tmp_path_factory.mktemp("lm-eval")
    if source.startswith("checkpoint:"):
        from yb_testkit.checkpoints import build_checkpoint

        source = str(build_checkpoint(source.removeprefix("checkpoint:"), root / "model"))
    cluster = LocalCluster(root / "cluster", "--model", source, "--model-name", SERVED)
    cluster.start(timeout_s=600)
    try:
        yield source, cluster
    finally:
        code = cluster.stop()
        assert code == 0, cluster.output()


def test_lm_eval_scores_equal_through_the_cluster_and_transformers(
    cluster: tuple[str, LocalCluster], tmp_path: Path
) -> None:
    source, running = cluster
    served, reference = scores_through_both(
        hf_model_dir(source), running.url, running.api_key, tmp_path
    )
    print(f"\nlm-eval local-completions: {served}\nlm-eval hf: {reference}")
    assert set(served) == set(reference) == {"yb_choice", "yb_ending", "yb_document"}
    for task, metrics in reference.items():
        assert set(served[task]) == set(metrics), task
        for metric, value in metrics.items():
            got = served[task][metric]
            if "perplexity" in metric:
                # exp(mean NLL): compared as the NLL it is the exponential of, so 1e-3 is
                # relative (a random model's is 1e18, where 1e-3 absolute means nothing).
                got, value = math.log(got), math.log(value)
            assert got == pytest.approx(value, abs=TOLERANCE), (task, metric)
    # The scores are real, not both degenerate.
    assert 0.0 < reference["yb_choice"]["acc"] <= 1.0
    assert reference["yb_document"]["word_perplexity"] > 1.0


# --- the prompt's logprobs against the engine's own ------------------------------------


def _engine_logprobs(source: str, ids: list[int], top: int) -> list[tuple[float, dict[int, float]]]:
    """Each prompt token's (after the first) logprob and top alternatives, computed here
    with the engine the cluster runs (its prefill's chunking)."""
    import torch

    from yb_core.config import PrefillEngineConfig
    from yb_engine import ModelRunner, PageAllocator, PagedKVCache
    from yb_engine.models import load_engine_model

    model = load_engine_model(ModelConfig(source=source), default_model_cache_dir())
    block = 64
    cache = PagedKVCache(model.config, -(-len(ids) // block), block)
    pages = PageAllocator(cache.num_pages).allocate(cache.num_pages)
    chunk = PrefillEngineConfig().chunk_size
    logits = ModelRunner(model, cache).prefill(ids, pages, chunk_size=chunk, all_logits=True)
    logp = torch.log_softmax(logits.float(), dim=-1)
    out = []
    for i in range(1, len(ids)):
        values, alternatives = logp[i - 1].topk(top)
        out.append(
            (
                float(logp[i - 1, ids[i]]),
                dict(zip(alternatives.tolist(), values.tolist(), strict=True)),
            )
        )
    return out


def _prefill_counter(running: LocalCluster, name: str) -> float:
    total = 0.0
    for instance in ("prefill-0", "prefill-1"):
        address = None
        for line in running.instance_log(instance).splitlines():
            if '"metrics_listening"' in line:
                record = json.loads(line)
                address = f"{record['host']}:{record['port']}"
        if address is None:
            continue
        text = httpx.get(
            f"http://{address}/metrics", headers=running.metrics_headers, timeout=10
        ).text
        for line in text.splitlines():
            if line.startswith(name + " "):
                total += float(line.split()[1])
    return total


def test_prompt_logprobs_equal_the_engines_also_from_a_cached_prefix(
    cluster: tuple[str, LocalCluster],
) -> None:
    source, running = cluster
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(hf_model_dir(source)))
    text = " ".join(_DOCUMENTS * 4)
    ids: list[int] = tokenizer(text, add_special_tokens=False).input_ids[:200]
    top = 3
    want = _engine_logprobs(source, ids, top)
    scored = "yb_prefill_prompt_logprobs_total"
    body = {"model": SERVED, "prompt": ids, "echo": True, "logprobs": top, "max_tokens": 0}
    plain = {"model": SERVED, "prompt": ids, "max_tokens": 1}
    answers = []
    with httpx.Client(base_url=running.url, headers=running.headers, timeout=300) as http:

        def complete(request: dict[str, Any]) -> dict[str, Any]:
            response = http.post("/v1/completions", json=request)
            assert response.status_code == 200, response.text
            answer: dict[str, Any] = response.json()
            return answer

        answers.append(complete(body))
        # Until the pool's index has the prompt's blocks: a request without the
        # prompt's logprobs reuses them.
        deadline = time.monotonic() + 60
        while complete(plain)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0:
            assert time.monotonic() < deadline, "the prompt's prefix was never reused"
            time.sleep(0.5)
        before = _prefill_counter(running, scored)
        answers.append(complete(body))  # its prefix is in the pool: computed whole anyway
    for answer in answers:
        (choice,) = answer["choices"]
        assert choice["finish_reason"] == "length"
        logprobs = choice["logprobs"]
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        assert len(logprobs["token_logprobs"]) == len(ids)
        for i, (value, alternatives) in enumerate(want, start=1):
            assert logprobs["token_logprobs"][i] == pytest.approx(value, abs=1e-5), i
            shown = logprobs["top_logprobs"][i]
            assert len(shown) <= top + 1, shown  # the alternatives and the prompt's token
            texts = [tokenizer.decode([token]) for token in alternatives]
            for lp, text in zip(alternatives.values(), texts, strict=True):
                # Texts of distinct ids may coincide (a byte-level token that is part of
                # a character decodes to U+FFFD): only an unambiguous one is compared.
                if text in shown and texts.count(text) == 1 and "\ufffd" not in text:
                    assert shown[text] == pytest.approx(lp, abs=1e-5), (i, text)
        # The whole prompt computed, nothing reused: a full prefill.
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert answer["usage"]["completion_tokens"] == 0
    assert _prefill_counter(running, scored) > before
