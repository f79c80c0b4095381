"""Datasets (JSONL / Parquet / datasets-on-disk), the data processor, bad rows, and the resumable loader."""

from __future__ import annotations

import json

import pytest
import torch

from common.models import build_tiny_tokenizer
from rollout.data import (
    DataProcessorConfig,
    DatasetError,
    PromptDataset,
    StatefulDataLoader,
    collate_datums,
    load_records,
)

ROWS = [
    {"problem": "1+1?", "answer": "2", "level": 1},
    {"problem": "What is 3*3?", "answer": "9", "level": 2},
    {"problem": "Solve x+2=5.", "answer": "3", "level": 1},
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_jsonl_parquet_and_datasets_dirs_load_the_same_rows(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    assert load_records(write_jsonl(tmp_path / "d.jsonl", ROWS)) == ROWS
    (tmp_path / "a.json").write_text(json.dumps(ROWS))
    assert load_records(tmp_path / "a.json") == ROWS
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "d.parquet")
    assert load_records(tmp_path / "d.parquet") == ROWS
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "hf"))
    assert load_records(tmp_path / "hf") == ROWS
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS), "test": datasets.Dataset.from_list(ROWS[:1])}).save_to_disk(
        str(tmp_path / "hfdict")
    )
    assert load_records(tmp_path / "hfdict") == ROWS
    assert load_records(tmp_path / "hfdict", split="test") == ROWS[:1]
    with pytest.raises(DatasetError, match="no split 'validation'"):
        load_records(tmp_path / "hfdict", split="validation")
    parts = tmp_path / "parts"
    parts.mkdir()
    write_jsonl(parts / "0.jsonl", ROWS[:2])
    pq.write_table(pa.Table.from_pylist(ROWS[2:]), parts / "1.parquet")
    assert load_records(parts) == ROWS
    # a split names a part of a save_to_disk directory; of a plain file or folder it was ignored (all rows read)
    for plain in (tmp_path / "d.jsonl", tmp_path / "d.parquet", parts):
        with pytest.raises(DatasetError, match=r"split='test' picks a split of a datasets save_to_disk directory; this is a plain"):
            load_records(plain, split="test")


def test_missing_path_and_unsupported_files(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        load_records(missing)
    with pytest.raises(FileNotFoundError, match=str(missing)):
        PromptDataset.from_path(missing, build_tiny_tokenizer())
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DatasetError, match="unsupported"):
        load_records(tmp_path / "x.csv")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n\n{"prompt": \n')
    with pytest.raises(DatasetError, match="line 3: invalid JSON"):
        load_records(bad)


def test_chat_template_processing(tok):
    cfg = DataProcessorConfig(
        prompt_template="Q: {problem}",
        ground_truth_key="answer",
        extra_env_keys=["level"],
        system_prompt="Be brief.",
        task_name="math",
        max_seq_length=256,
    )
    ds = PromptDataset(ROWS, tok, cfg)
    assert len(ds) == 3
    d = ds[1]
    assert [m["role"] for m in d["message_log"]] == ["system", "user"]
    ids = torch.cat([m["token_ids"] for m in d["message_log"]])
    assert all(m["token_ids"].dtype == torch.int64 for m in d["message_log"])
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q: What is 3*3?"}]
    expected = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert ids.tolist() == list(expected)  # the pieces concatenate to the full rendering
    for m in d["message_log"]:  # content is what the tokens decode to
        assert tok.decode(m["token_ids"]) == m["content"]
    assert d["message_log"][1]["content"].endswith("<|im_start|>assistant\n")
    assert d["length"] == ids.numel() and d["loss_multiplier"] == 1.0
    assert d["extra_env_info"] == {"ground_truth": "9", "level": 2}
    assert d["idx"] == 1 and d["task_name"] == "math"
    batch = collate_datums([ds[0], ds[2]])
    assert batch["idx"].tolist() == [0, 2] and batch["loss_multiplier"].dtype == torch.float32
    assert batch["length"].tolist() == [ds[0]["length"], ds[2]["length"]]


def test_plain_prompt_and_message_list_rows(tok):
    ds = PromptDataset(
        [{"prompt": "2+3=", "ground_truth": 5, "task_name": "builtin_add"}], tok, DataProcessorConfig(use_chat_template=False)
    )
    d = ds[0]
    assert [m["role"] for m in d["message_log"]] == ["user"]
    assert d["message_log"][0]["token_ids"].tolist() == tok("2+3=")["input_ids"]
    assert d["extra_env_info"]["ground_truth"] == "5" and d["task_name"] == "builtin_add"
    rows = [
        {
            "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}, {"role": "user", "content": "3?"}],
            "ground_truth": "3",
        }
    ]
    d = PromptDataset(rows, tok, DataProcessorConfig(messages_key="messages"))[0]
    assert [m["role"] for m in d["message_log"]] == ["user", "assistant", "user"]
    expected = tok.apply_chat_template(rows[0]["messages"], add_generation_prompt=True, tokenize=True)["input_ids"]
    assert torch.cat([m["token_ids"] for m in d["message_log"]]).tolist() == list(expected)
    assert d["task_name"] == "default"


def test_overlong_prompt_is_truncated_and_masked(tok):
    rows = [{"prompt": "short", "ground_truth": "1"}, {"prompt": "x" * 200, "ground_truth": "1"}]
    ds = PromptDataset(rows, tok, DataProcessorConfig(max_seq_length=40))
    ok, long = ds[0], ds[1]
    assert ok["loss_multiplier"] == 1.0 and ok["length"] < 40
    assert long["loss_multiplier"] == 0.0 and long["length"] == 40
    full = tok.apply_chat_template([{"role": "user", "content": "x" * 200}], add_generation_prompt=True, tokenize=True)["input_ids"]
    kept = torch.cat([m["token_ids"] for m in long["message_log"]]).tolist()
    assert kept == list(full[:40])  # the first max_seq_length tokens are kept
    assert long["message_log"][0]["content"] == tok.decode(kept)


@pytest.mark.parametrize(
    "rows, cfg, match",
    [
        ([{"prompt": "a", "ground_truth": "1"}, {"prompt": "b"}], {}, "row 1: field 'ground_truth' .* is missing"),
        (
            [{"prompt": "a", "ground_truth": "1"}] * 2 + [{"prompt": 7, "ground_truth": "1"}],
            {},
            "row 2: field 'prompt' .* must be a string, got int",
        ),
        ([{"ground_truth": "1"}], {}, "row 0: field 'prompt' .* is missing"),
        ([{"prompt": "a", "ground_truth": "1"}, {"prompt": " \n", "ground_truth": "1"}], {}, "row 1: field 'prompt' .* is empty"),
        ([{"prompt": "a", "ground_truth": ["1"]}], {}, "row 0: field 'ground_truth' .* must be a string or number, got list"),
        (
            [{"problem": "a", "ground_truth": "1"}, {"ground_truth": "1"}],
            {"prompt_template": "Q: {problem}"},
            "row 1: field 'problem' .*prompt_template.* is missing",
        ),
        ([["not", "a", "dict"]], {}, "row 0: expected a mapping"),
        ([{"messages": [{"role": "user"}], "ground_truth": "1"}], {"messages_key": "messages"}, "row 0: field 'messages'.*message 0"),
        ([{"prompt": "a", "ground_truth": "1"}], {"extra_env_keys": ["level"]}, "row 0: field 'level'"),
    ],
)
def test_malformed_rows_name_the_row_and_field(tok, rows, cfg, match):
    with pytest.raises(DatasetError, match=match):
        PromptDataset(rows, tok, DataProcessorConfig(**cfg))


def test_malformed_row_in_a_file_fails_at_load(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "ground_truth": "1"}, {"prompt": "b", "ground_truth": None}])
    with pytest.raises(DatasetError, match="row 1: field 'ground_truth'"):
        PromptDataset.from_path(path, tok)


def take(loader, n):
    return [loader.next_batch() for _ in range(n)]


def test_loader_resumes_exactly_where_it_stopped():
    data = list(range(10))
    uninterrupted = take(StatefulDataLoader(data, 3, seed=4), 8)  # 3 batches per epoch: crosses 2 epochs
    first = StatefulDataLoader(data, 3, seed=4)
    head = take(first, 4)
    state = json.loads(json.dumps(first.state_dict()))  # survives a JSON checkpoint
    resumed = StatefulDataLoader(data, 3, seed=4)
    resumed.load_state_dict(state)
    assert head + take(resumed, 4) == uninterrupted

    # The same through epoch iteration, stopping mid-epoch.
    a = StatefulDataLoader(data, 3, seed=9)
    full = [b for _ in range(2) for b in a]
    b = StatefulDataLoader(data, 3, seed=9)
    it = iter(b)
    got = [next(it)]
    c = StatefulDataLoader(data, 3, seed=9)
    c.load_state_dict(b.state_dict())
    got += list(c) + list(c)
    assert got == full


def test_loader_shuffles_per_epoch_with_a_seed(tok):
    data = list(range(10))
    loader = StatefulDataLoader(data, 4, seed=1, drop_last=False)
    assert len(loader) == 3
    e0, e1 = [x for b in loader for x in b], [x for b in loader for x in b]
    assert sorted(e0) == sorted(e1) == data  # every row once per epoch
    assert e0 != e1 and e0 != data  # reshuffled every epoch
    assert [x for b in StatefulDataLoader(data, 4, seed=1, drop_last=False) for x in b] == e0
    assert [x for b in StatefulDataLoader(data, 4, shuffle=False, drop_last=False) for x in b] == data
    assert [len(b) for b in StatefulDataLoader(data, 4, seed=1)] == [4, 4]  # drop_last
    with pytest.raises(ValueError, match="batch_size=4, this loader has 5"):
        StatefulDataLoader(data, 5).load_state_dict(loader.state_dict())
    with pytest.raises(ValueError, match="no batch"):
        StatefulDataLoader(data[:2], 4)
    # With a PromptDataset and the collate function: batches of processed records.
    ds = PromptDataset([{"prompt": f"{i}+1=", "ground_truth": str(i + 1)} for i in range(6)], tok)
    batch = StatefulDataLoader(ds, 2, seed=0, collate_fn=collate_datums).next_batch()
    assert len(batch["message_log"]) == 2 and batch["idx"].shape == (2,)


def test_unreadable_files_are_one_line_dataset_errors(tmp_path):
    bad_byte = tmp_path / "latin1.jsonl"
    bad_byte.write_bytes(b'{"prompt": "a", "ground_truth": "1"}\n{"prompt": "caf\xff", "ground_truth": "1"}\n')
    with pytest.raises(DatasetError, match=r"latin1.jsonl: line 2: not UTF-8 text \(byte 0xff"):
        load_records(bad_byte)
    not_parquet = tmp_path / "fake.parquet"
    not_parquet.write_text('{"prompt": "a"}\n')
    with pytest.raises(DatasetError, match=r"fake.parquet: not a readable Parquet file \(.*magic bytes"):
        load_records(not_parquet)
    (tmp_path / "empty.parquet").write_bytes(b"")
    with pytest.raises(DatasetError, match="empty.parquet: not a readable Parquet file"):
        load_records(tmp_path / "empty.parquet")
    # A UTF-8 byte-order mark (some Windows tools write one) is not part of the first row.
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps(r) + "\n" for r in ROWS).encode())
    assert load_records(bom) == ROWS
    (tmp_path / "bom.json").write_bytes(b"\xef\xbb\xbf" + json.dumps(ROWS).encode())
    assert load_records(tmp_path / "bom.json") == ROWS


def test_max_seq_length_no_prompt_fits_is_refused_and_most_cut_warns(tok, caplog, monkeypatch):
    rows = [{"prompt": "x" * n, "ground_truth": "1"} for n in (30, 12, 50)]
    shortest = len(tok.apply_chat_template([{"role": "user", "content": "x" * 12}], add_generation_prompt=True, tokenize=True)["input_ids"])
    with pytest.raises(DatasetError, match=f"max_seq_length=10 is shorter than every prompt .*row 1, has {shortest} tokens"):
        PromptDataset(rows, tok, DataProcessorConfig(max_seq_length=10))
    PromptDataset(rows, tok, DataProcessorConfig(max_seq_length=shortest))  # one fits: a run can train
    assert "longer than data.processor.max_seq_length" in caplog.text  # but 2 of 3 are cut: warned
    caplog.clear()
    PromptDataset(rows, tok, DataProcessorConfig(max_seq_length=1000))
    assert "max_seq_length" not in caplog.text
    # Past the sample only the rows needed are tokenized: the one that fits is found beyond it.
    monkeypatch.setattr("rollout.data._LENGTH_SAMPLE", 2)
    PromptDataset([{"prompt": "x" * 50, "ground_truth": "1"}] * 2 + rows[1:2] + rows[:1], tok, DataProcessorConfig(max_seq_length=shortest))


def test_unknown_task_names_are_refused_at_load(tmp_path, tok):
    rows = [{"prompt": "1+1=", "ground_truth": "2", "task_name": "math"}] * 7 + [
        {"prompt": "1+2=", "ground_truth": "3", "task_name": "mathh"}
    ]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(DatasetError, match=r"row 7: task_name 'mathh' names no environment of this run \(environments: \['math'\]\)"):
        PromptDataset.from_path(path, tok, known_tasks=["math"])
    untagged = [{"prompt": "1+1=", "ground_truth": "2"}]
    with pytest.raises(
        DatasetError,
        match="row 0: task 'default' .*no task_name field and data.processor.task_name is null.*set data.processor.task_name=math",
    ):
        PromptDataset(untagged, tok, known_tasks={"math"})
    assert PromptDataset(untagged, tok, DataProcessorConfig(task_name="math"), known_tasks={"math"})[0]["task_name"] == "math"
    with pytest.raises(DatasetError, match="data.processor.task_name='mathh' names no environment"):
        PromptDataset(untagged, tok, DataProcessorConfig(task_name="mathh"), known_tasks={"math"})
    assert len(PromptDataset(rows[:7], tok, known_tasks=["math"])) == 7
