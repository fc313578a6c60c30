"""Small lm-eval tasks the evaluation tests write themselves: facts "SUBJECT is COLOR." as
training text, and three task YAML files over local JSON lines (no hub)."""

from __future__ import annotations

import json
import random
from pathlib import Path

SUBJECTS = ["the sky", "the grass", "the sun", "the snow", "the coal", "the rose", "the sea", "the plum"]
COLORS = ["blue", "green", "yellow", "white", "black", "red", "teal", "purple"]
FACTS = [f"{s} is {c}." for s, c in zip(SUBJECTS, COLORS, strict=True)]


def write_corpus(folder: Path, *, docs: int = 240) -> Path:
    """Documents of facts in shuffled order: what the trained model learns."""
    rnd = random.Random(0)
    path = folder / "facts.jsonl"
    with path.open("w") as fh:
        for _ in range(docs):
            fh.write(json.dumps({"text": " ".join(rnd.sample(FACTS, 4))}) + "\n")
    return path


def write_tasks(folder: Path) -> Path:
    """A folder with the tasks facts_mc (4 choices), facts_text (rolling) and facts_gen (generate_until)."""
    folder.mkdir(parents=True, exist_ok=True)
    folder = folder.resolve()
    rnd = random.Random(1)
    mc = []
    for s, c in zip(SUBJECTS, COLORS, strict=True):
        wrong = rnd.sample([x for x in COLORS if x != c], 3)
        choices = [c, *wrong]
        rnd.shuffle(choices)
        mc.append({"subject": s, "color": c, "choices": choices, "label": choices.index(c)})
    _jsonl(folder / "mc.jsonl", mc)
    _jsonl(folder / "text.jsonl", [{"text": " ".join(FACTS[i : i + 3])} for i in range(0, 8, 2)])
    data = lambda name: {"dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(folder / name)}}, "test_split": "test"}  # noqa: E731
    _yaml(
        folder / "facts_mc.yaml",
        {
            "task": "facts_mc",
            **data("mc.jsonl"),
            "output_type": "multiple_choice",
            "doc_to_text": "{{subject}} is",
            "doc_to_choice": "choices",
            "doc_to_target": "label",
            "metric_list": [{"metric": "acc"}, {"metric": "acc_norm"}],
        },
    )
    _yaml(
        folder / "facts_text.yaml",
        {
            "task": "facts_text",
            **data("text.jsonl"),
            "output_type": "loglikelihood_rolling",
            "doc_to_text": "",
            "doc_to_target": "{{text}}",
            "metric_list": [{"metric": "word_perplexity"}, {"metric": "byte_perplexity"}, {"metric": "bits_per_byte"}],
        },
    )
    _yaml(
        folder / "facts_gen.yaml",
        {
            "task": "facts_gen",
            **data("mc.jsonl"),
            "output_type": "generate_until",
            "doc_to_text": "{{subject}} is",
            "doc_to_target": " {{color}}",
            "generation_kwargs": {"until": ["."], "max_gen_toks": 6, "do_sample": False},
            "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True, "regexes_to_ignore": [" "]}],
        },
    )
    return folder


def _jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _yaml(path: Path, data: dict) -> None:
    import yaml

    path.write_text(yaml.safe_dump(data, sort_keys=False))
