"""Bad data: every user mistake is a UserError naming the file and the fix, with nothing left behind."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from llmforge.commands.data import prepare_command
from llmforge.config.schema import DataConfig, RunConfig
from llmforge.data.prepare import prepare
from llmforge.data.tokenizer import token_dtype
from llmforge.errors import UserError
from llmforge.plan import RunPlan

VOCAB = 300


def _prepare(tmp_path: Path, **fields):
    return prepare(data=DataConfig(cache_dir=str(tmp_path / "cache"), **fields), vocab_size=VOCAB, seed=0)


def _assert_nothing_cached(tmp_path: Path) -> None:
    prepared = tmp_path / "cache" / "prepared"
    left = [p.name for p in prepared.iterdir() if not p.name.endswith(".lock")] if prepared.exists() else []
    assert left == []


def _error(tmp_path: Path, **fields) -> str:
    with pytest.raises(UserError) as info:
        _prepare(tmp_path, **fields)
    _assert_nothing_cached(tmp_path)
    return info.value.message()


def test_missing_file_names_the_path(tmp_path):
    message = _error(tmp_path, path=str(tmp_path / "nope.jsonl"))
    assert "nope.jsonl" in message and "no such file" in message and "Fix:" in message


def test_missing_dataset_name_is_not_downloaded(tmp_path):
    message = _error(tmp_path, path="someone/not-a-cached-dataset")
    assert "not-a-cached-dataset" in message and "nothing is downloaded" in message


def test_empty_file(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    assert "empty" in _error(tmp_path, path=str(tmp_path / "empty.txt"))


def test_non_utf8_bytes_name_the_file_and_offset(tmp_path):
    (tmp_path / "latin.txt").write_bytes("caf\u00e9 ok\n".encode("utf-8") + "na\u00efve".encode("latin-1"))
    message = _error(tmp_path, path=str(tmp_path / "latin.txt"))
    assert "latin.txt" in message and "byte 11 is not valid UTF-8" in message and "iconv" in message


def test_missing_text_column_lists_the_columns(tmp_path):
    (tmp_path / "d.jsonl").write_text(json.dumps({"body": "hello"}) + "\n")
    message = _error(tmp_path, path=str(tmp_path / "d.jsonl"))
    assert "data.text_key" in message and "'body'" in message


def test_broken_json_is_reported_with_the_file(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"text": "fine"}\n{"text": broken\n')
    message = _error(tmp_path, path=str(tmp_path / "d.jsonl"))
    assert "d.jsonl" in message and "could not be read as json" in message


def test_unsupported_type_and_empty_folder(tmp_path):
    (tmp_path / "a.csv").write_text("x\n")
    assert "unsupported file type .csv" in _error(tmp_path, path=str(tmp_path / "a.csv"))
    (tmp_path / "folder").mkdir()
    assert "holds no .txt, .md, .jsonl, .json or .parquet files" in _error(tmp_path, path=str(tmp_path / "folder"))
    (tmp_path / "folder" / "b.csv").write_text("x\n")
    assert "(it holds 1 file(s) of a type llmforge does not read (b.csv;" in _error(tmp_path, path=str(tmp_path / "folder"))


def test_a_device_is_not_called_missing(tmp_path):
    message = _error(tmp_path, path="/dev/zero")
    assert "/dev/zero" in message and "neither a regular file nor a folder" in message and "no such file" not in message


def test_files_of_other_types_in_a_folder_are_named_as_skipped(tmp_path):
    folder = tmp_path / "f"
    folder.mkdir()
    (folder / "a.txt").write_text("some text\n")
    (folder / "table.csv").write_text("x,y\n")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _prepare(tmp_path, path=str(folder))
    text = " ".join(str(w.message) for w in caught)
    assert "1 file(s) of a type llmforge does not read (table.csv; it reads .txt" in text


@pytest.mark.parametrize("values,found", [(["a", 5], "integer and string"), ([1, 2], "integer"), ([["a"]], "list")])
def test_a_text_column_of_other_values_names_file_column_and_types(tmp_path, values, found):
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": v}) + "\n" for v in values))
    message = _error(tmp_path, path=str(tmp_path / "d.jsonl"))
    first = next(i for i, v in enumerate(values, 1) if not isinstance(v, str))
    assert f"d.jsonl: column 'text' holds {found} values" in message and f"row {first}" in message and "?" not in message


def test_a_parquet_text_column_of_integers_is_named(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "d.parquet")
    assert "d.parquet: column 'text' holds int64 values" in _error(tmp_path, path=str(tmp_path / "d.parquet"))


def test_only_empty_documents_is_an_error_not_an_empty_dataset(tmp_path):
    (tmp_path / "d.jsonl").write_text(json.dumps({"text": ""}) + "\n" + json.dumps({"text": None}) + "\n")
    assert "every document is empty" in _error(tmp_path, path=str(tmp_path / "d.jsonl"))


def test_empty_documents_and_files_are_skipped_with_a_count(tmp_path):
    folder = tmp_path / "f"
    folder.mkdir()
    rows = [{"text": "one good document"}, {"text": ""}, {"text": "another good one"}]
    (folder / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "b.jsonl").write_text("")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prepared = _prepare(tmp_path, path=str(folder))
    assert prepared.streams[0].num_documents == 2
    text = " ".join(str(w.message) for w in caught)
    assert "1 empty document" in text and "b.jsonl: empty file" in text
    manifest = json.loads((prepared.root / "manifest.json").read_text())
    assert manifest["streams"][0]["skipped_empty"] == 1


def test_vocabulary_sizes_out_of_range(tmp_path):
    (tmp_path / "d.txt").write_text("text\n")
    with pytest.raises(UserError, match="at least 257"):
        prepare(data=DataConfig(path=str(tmp_path / "d.txt"), cache_dir=str(tmp_path)), vocab_size=100, seed=0)
    with pytest.raises(UserError, match="uint32"):
        token_dtype(2**33)
    assert token_dtype(65536).name == "uint16" and token_dtype(65537).name == "uint32"


def test_data_vocab_larger_than_model_vocab(tmp_path):
    config = RunConfig()
    config.data.cache_dir = str(tmp_path)
    config.data.vocab_size = config.model.vocab_size * 2
    with pytest.raises(UserError, match="model.vocab_size"):
        prepare_command(RunPlan.build(config), force=False, console=None)


def test_tokenizer_too_large_or_unreadable(tmp_path):
    (tmp_path / "d.txt").write_text("some text here\n" * 50)
    base = _prepare(tmp_path, path=str(tmp_path / "d.txt"))
    with pytest.raises(UserError, match="model.vocab_size"):
        prepare(
            data=DataConfig(path=str(tmp_path / "d.txt"), tokenizer=str(base.tokenizer_path), cache_dir=str(tmp_path / "c2")),
            vocab_size=base.vocab_size - 1,
            seed=0,
        )
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(UserError, match="bad.json"):
        _prepare(tmp_path, path=str(tmp_path / "d.txt"), tokenizer=str(tmp_path / "bad.json"))


def test_a_tokenizer_given_to_generate_is_named_as_its_option(tmp_path):
    from llmforge.data.tokenizer import load_tokenizer

    (tmp_path / "bad.json").write_text("{not json")
    for path in (tmp_path / "bad.json", tmp_path / "nope.json"):
        with pytest.raises(UserError) as info:
            load_tokenizer(str(path), vocab_size=VOCAB, key="--tokenizer")
        assert info.value.problems[0].key == "--tokenizer" and "data.tokenizer" not in info.value.message()


def test_bad_mixture_entries_are_all_reported(tmp_path):
    with pytest.raises(UserError) as info:
        _prepare(tmp_path, mixture=["a.jsonl", "b.jsonl:-1", "c.jsonl:x"])
    assert len(info.value.problems) == 3 and "PATH:WEIGHT" in info.value.message()


def test_files_source_without_path(tmp_path):
    assert "data.path" in _error(tmp_path, source="files")
