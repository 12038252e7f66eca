"""Sources and token windows."""

import json

import pytest
import torch

from moecompress.calibration.batches import consecutive_windows, sampled_windows, tokenize_documents
from moecompress.calibration.builtin_corpus import builtin_documents
from moecompress.calibration.sources import load_documents, parse_hf_spec
from moecompress.errors import UserInputError


@pytest.mark.parametrize("name", ["prose", "code"])
def test_builtin_split_is_deterministic_and_disjoint(name):
    calib = builtin_documents(name, "calib")
    heldout = builtin_documents(name, "heldout")
    assert calib and heldout
    assert not {d.id for d in calib} & {d.id for d in heldout}
    assert len(calib) + len(heldout) == len(builtin_documents(name, "all"))
    assert [d.id for d in builtin_documents(name, "heldout")] == [d.id for d in heldout]
    assert {d.tag for d in calib} == {name}


def test_spec_parts_and_combinations():
    assert load_documents("builtin:prose", default_part="heldout") == builtin_documents("prose", "heldout")
    both = load_documents("builtin:prose:calib,builtin:code:heldout")
    assert {d.tag for d in both} == {"prose", "code"}
    with pytest.raises(UserInputError, match="unknown built-in source"):
        load_documents("builtin:poetry")
    with pytest.raises(UserInputError, match="no such data file"):
        load_documents("/no/such/file.txt")


def test_local_files(tmp_path):
    (tmp_path / "a.txt").write_text("plain text file")
    (tmp_path / "b.jsonl").write_text(
        json.dumps({"text": "one", "tag": "vision"}) + "\n\n" + json.dumps({"text": "two"}) + "\n"
    )
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["p1", "p2", None]}), tmp_path / "c.parquet")
    docs = load_documents(str(tmp_path))
    assert [d.text for d in docs] == ["plain text file", "one", "two", "p1", "p2"]
    assert [d.tag for d in docs][:3] == ["a", "vision", "b"]
    (tmp_path / "bad.jsonl").write_text("{not json}\n")
    with pytest.raises(UserInputError, match=r"bad.jsonl:1: invalid JSON"):
        load_documents(str(tmp_path / "bad.jsonl"))


def test_hf_spec_parsing():
    assert parse_hf_spec("hf:wikitext") == ("wikitext", None, "train")
    assert parse_hf_spec("hf:wikitext:wikitext-2-raw-v1") == ("wikitext", "wikitext-2-raw-v1", "train")
    assert parse_hf_spec("hf:wikitext:test[:100]") == ("wikitext", None, "test[:100]")
    assert parse_hf_spec("hf:wikitext:wikitext-2-raw-v1:validation") == ("wikitext", "wikitext-2-raw-v1", "validation")


def test_hf_dataset_goes_through_datasets(tmp_path):
    """The hf: path really calls datasets.load_dataset; here with a local parquet-backed dataset directory."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = tmp_path / "mydata" / "data"
    data.mkdir(parents=True)
    pq.write_table(pa.table({"text": ["alpha", "beta"]}), data / "train-00000-of-00001.parquet")
    docs = load_documents(f"hf:{tmp_path / 'mydata'}")
    assert [d.text for d in docs] == ["alpha", "beta"]
    with pytest.raises(UserInputError, match="could not load dataset"):
        load_documents("hf:no-such-org/no-such-dataset")


class _CharTokenizer:
    def __call__(self, texts, add_special_tokens=False):
        assert add_special_tokens is False
        return {"input_ids": [[ord(c) for c in text] for text in texts]}


def test_windows_carry_tags_and_are_reproducible():
    docs = load_documents("builtin:prose:heldout,builtin:code:heldout")
    stream = tokenize_documents(docs, _CharTokenizer())
    assert len(stream) == sum(len(d.text) + 2 for d in docs)
    windows = consecutive_windows(stream, 128, max_tokens=128 * 10)
    assert windows.input_ids.shape == (10, 128)
    assert windows.tag_names == ["code", "prose"]
    first = docs[0]
    assert windows.tags[0, 0].item() == windows.tag_names.index(first.tag)
    a = sampled_windows(stream, 64, 64 * 20, seed=3)
    b = sampled_windows(stream, 64, 64 * 20, seed=3)
    c = sampled_windows(stream, 64, 64 * 20, seed=4)
    assert torch.equal(a.input_ids, b.input_ids) and not torch.equal(a.input_ids, c.input_ids)
    assert set(a.tags.unique().tolist()) == {0, 1}
    with pytest.raises(UserInputError, match="fewer than one window"):
        consecutive_windows(stream, 10**9)
