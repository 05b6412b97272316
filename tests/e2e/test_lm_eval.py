"""lm-eval (from PyPI) against a running deployment, and the same tasks through lm-eval's own
`hf` backend on the same checkpoint: `local-completions` scores a multiple-choice task from
`/v1/completions` (token-id prompts in batches, `echo`, `logprobs: 1`, `max_tokens: 1`), and
`local-chat-completions` answers a generation task through `/v1/chat/completions`. The
per-example loglikelihoods agree within 1e-4, the answers exactly, and so do the scores. The
task ships with the tests (a local JSONL file; nothing comes from the hub)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from mmserve.tiny.checkpoints import build_tiny_model
from tests.support.deployment import Deployment

DATA = Path(__file__).parent / "data" / "lm_eval_tiny.jsonl"
MODEL = "tiny-qwen2_vl-seed0"
TASKS = {
    "mmserve_tiny_choice": """
output_type: multiple_choice
doc_to_text: "{{question}}"
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
metric_list:
  - metric: acc
""",
    "mmserve_tiny_reply": """
output_type: generate_until
doc_to_text: "{{question}}"
doc_to_target: "{{reply}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
""",
}


@pytest.fixture(scope="module")
def tasks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("lm-eval-tasks")
    for name, body in TASKS.items():
        head = f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        head += f"    test: {DATA}\ntest_split: test\n"
        (folder / f"{name}.yaml").write_text(head + body)
    return folder


@pytest.fixture(scope="module")
def agg(nats_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    deployment = Deployment(
        "agg", build_tiny_model("qwen2_vl"), nats_url, tmp_path_factory.mktemp("lm-eval-logs")
    )
    with deployment.running():
        yield deployment


def evaluate(model: Any, task: str, tasks: Path, **options: Any) -> dict[str, Any]:
    import lm_eval
    from lm_eval.tasks import TaskManager

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    return lm_eval.simple_evaluate(
        model=model,
        tasks=[task],
        task_manager=TaskManager(include_path=str(tasks)),
        log_samples=True,
        **options,
    )


def hf_backend() -> Any:
    from lm_eval.models.huggingface import HFLM

    path = build_tiny_model("qwen2_vl")
    model = transformers.Qwen2VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
    return HFLM(pretrained=model, tokenizer=transformers.AutoTokenizer.from_pretrained(path))


def per_example(result: dict[str, Any], task: str) -> list[Any]:
    samples = sorted(result["samples"][task], key=lambda sample: sample["doc_id"])
    return [sample["filtered_resps"] for sample in samples]


def test_loglikelihoods_through_completions_equal_lm_evals_hf_backend(
    agg: Deployment, tasks: Path
) -> None:
    task = "mmserve_tiny_choice"
    args = (
        f"model={MODEL},base_url={agg.base_url}/v1/completions,tokenizer_backend=huggingface,"
        f"tokenizer={build_tiny_model('qwen2_vl')},tokenized_requests=True,batch_size=4,"
        "num_concurrent=1,max_retries=1"
    )
    served = evaluate("local-completions", task, tasks, model_args=args)
    reference = evaluate(hf_backend(), task, tasks)
    ours, theirs = per_example(served, task), per_example(reference, task)
    assert len(ours) == len(theirs) == 6
    for got, expected in zip(ours, theirs, strict=True):
        assert [greedy for _, greedy in got] == [greedy for _, greedy in expected]
        assert [value for value, _ in got] == pytest.approx(
            [value for value, _ in expected], abs=1e-4
        )
    assert served["results"][task]["acc,none"] == reference["results"][task]["acc,none"]


def test_answers_through_chat_completions_equal_lm_evals_hf_backend(
    agg: Deployment, tasks: Path
) -> None:
    task = "mmserve_tiny_reply"
    args = (
        f"model={MODEL},base_url={agg.base_url}/v1/chat/completions,tokenizer_backend=None,"
        "num_concurrent=1,max_retries=1"
    )
    served = evaluate(
        "local-chat-completions", task, tasks, model_args=args, apply_chat_template=True
    )
    reference = evaluate(hf_backend(), task, tasks, apply_chat_template=True)
    ours, theirs = per_example(served, task), per_example(reference, task)
    assert len(ours) == 6 and ours == theirs
    assert any(answer for (answer,) in ours)  # the model says something
    score = "exact_match,none"
    assert served["results"][task][score] == reference["results"][task][score]
