"""Training data layouts (ShareGPT, UltraChat) and containers (Parquet, Arrow, save_to_disk):
each gives the token ids, loss mask and prompt length of the equivalent `messages` record or
JSONL file."""

import json
import sys

import pytest

from tests.deps import need
from vllm_moa.training.data import load_examples

SYSTEM = {"role": "system", "content": "be brief"}
CHAT = [
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "hello there"},
    {"role": "user", "content": "more"},
    {"role": "assistant", "content": "ok"},
]
SHAREGPT = {
    "conversations": [
        {"from": "system", "value": "be brief"},
        {"from": "human", "value": "hi"},
        {"from": "gpt", "value": "hello there"},
        {"from": "human", "value": "more"},
        {"from": "gpt", "value": "ok"},
    ]
}
# Each layout next to the `messages` it must equal.
LAYOUTS = {
    "sharegpt": (SHAREGPT, [SYSTEM, *CHAT]),
    "sharegpt_aliases": (
        {
            "conversations": [
                {"from": "user", "value": "hi"},
                {"from": "chatgpt", "value": "hello there"},
                {"from": "Human", "value": "more"},
                {"from": "bard", "value": "ok"},
            ]
        },
        CHAT,
    ),
    "sharegpt_role_content": ({"conversations": [SYSTEM, *CHAT]}, [SYSTEM, *CHAT]),
    "ultrachat": ({"data": [m["content"] for m in CHAT]}, CHAT),
    "ultrachat_200k": ({"prompt": "hi", "prompt_id": "0f3a", "messages": CHAT}, CHAT),
}
# One row per layout: in a table, every row carries every column (null where it has none).
MIXED = [
    *(record for record, _ in LAYOUTS.values()),
    {"messages": CHAT},
    {"question": "1+1?", "answer": "2"},
    {"text": "def f(x):\n    return x\n" * 4},
]


@pytest.fixture(scope="module")
def tokenizer(tiny_target_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_target_dir)


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _load(tokenizer, path):
    return load_examples([path], tokenizer, max_length=64)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_equals_messages(tmp_path, tokenizer, layout):
    record, messages = LAYOUTS[layout]
    got = _load(tokenizer, _jsonl(tmp_path / "layout.jsonl", [record]))
    want = _load(tokenizer, _jsonl(tmp_path / "messages.jsonl", [{"messages": messages}]))
    # The reference trains on the assistant turns only: some tokens are targets, some are not.
    assert any(want[0].loss_mask) and not all(want[0].loss_mask)
    assert got == want


def test_layout_equality_control_swapped_roles(tmp_path, tokenizer):
    """The equality above can fail: ShareGPT with human and gpt swapped trains on other tokens."""
    swap = {"human": "gpt", "gpt": "human", "system": "system"}
    turns = [{**t, "from": swap[t["from"]]} for t in SHAREGPT["conversations"]]
    got = _load(tokenizer, _jsonl(tmp_path / "swapped.jsonl", [{"conversations": turns}]))
    want = _load(tokenizer, _jsonl(tmp_path / "messages.jsonl", [{"messages": [SYSTEM, *CHAT]}]))
    assert got[0].input_ids != want[0].input_ids
    assert got[0].loss_mask != want[0].loss_mask


def _table(records):
    pa = need("pyarrow")
    # pa.array infers one struct type over every row (Table.from_pylist reads the first only).
    return pa.Table.from_batches([pa.RecordBatch.from_struct_array(pa.array(records))])


def _write_stream(path, table):
    pa = need("pyarrow")
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)


def _write(container, tmp_path, records):
    """`records` in `container`, as datasets / pyarrow users write them; returns the data path."""
    pa = need("pyarrow")
    table = _table(records)
    if container == "parquet":
        import pyarrow.parquet as pq

        pq.write_table(table, tmp_path / "d.parquet")
        return tmp_path / "d.parquet"
    if container == "arrow_stream":  # datasets' .arrow files
        _write_stream(tmp_path / "d.arrow", table)
        return tmp_path / "d.arrow"
    if container == "arrow_file":
        sink = pa.OSFile(str(tmp_path / "d.arrow"), "wb")
        with sink, pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)
        return tmp_path / "d.arrow"
    if container == "feather":
        import pyarrow.feather as feather

        feather.write_feather(table, tmp_path / "d.feather")
        return tmp_path / "d.feather"
    # save_to_disk: shards listed in state.json, whose order (not the names') is the data order.
    out = tmp_path / "saved"
    out.mkdir()
    half = len(records) // 2
    names = ["data-00001-of-00002.arrow", "data-00000-of-00002.arrow"]
    _write_stream(out / names[0], table.slice(0, half))
    _write_stream(out / names[1], table.slice(half))
    (out / "state.json").write_text(json.dumps({"_data_files": [{"filename": n} for n in names]}))
    (out / "dataset_info.json").write_text("{}")
    return out


@pytest.mark.parametrize("rows", ["mixed", "sharegpt"])
@pytest.mark.parametrize(
    "container", ["parquet", "arrow_stream", "arrow_file", "feather", "save_to_disk"]
)
def test_tables_equal_jsonl(tmp_path, tokenizer, container, rows):
    records = MIXED if rows == "mixed" else [SHAREGPT, LAYOUTS["sharegpt_aliases"][0]]
    want = _load(tokenizer, _jsonl(tmp_path / "same.jsonl", records))
    assert len(want) >= len(records)
    assert _load(tokenizer, _write(container, tmp_path, records)) == want


def test_unknown_role(tmp_path, tokenizer):
    bad = {"conversations": [{"from": "human", "value": "hi"}, {"from": "narrator", "value": "x"}]}
    path = _jsonl(tmp_path / "roles.jsonl", [SHAREGPT, bad])
    where = r"roles\.jsonl:2: .*turn 1 has unknown role 'narrator'"
    fix = r"known: human/user \(user\).*Rename it in the data"
    with pytest.raises(ValueError, match=rf"{where}.*{fix}"):
        _load(tokenizer, path)
    need("pyarrow")
    with pytest.raises(ValueError, match=r"d\.parquet row 1: .*unknown role 'narrator'"):
        _load(tokenizer, _write("parquet", tmp_path, [SHAREGPT, bad]))


def test_layout_errors(tmp_path, tokenizer):
    with pytest.raises(ValueError, match=r"x\.jsonl:1: `data` \(UltraChat.*int at position 1"):
        _load(tokenizer, _jsonl(tmp_path / "x.jsonl", [{"data": ["hi", 3]}]))
    with pytest.raises(ValueError, match=r"x\.jsonl:1: .*turn 0 needs `from`/`value`"):
        _load(tokenizer, _jsonl(tmp_path / "x.jsonl", [{"conversations": [{"speaker": "a"}]}]))
    with pytest.raises(ValueError, match=r"x\.jsonl:1: .*has no `messages`.*`conversations`"):
        _load(tokenizer, _jsonl(tmp_path / "x.jsonl", [{"foo": 1}]))


def test_missing_pyarrow(tmp_path, tokenizer, monkeypatch):
    path = tmp_path / "d.parquet"
    path.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # `import pyarrow` raises ImportError
    fix = r"pip install 'vllm-moa\[data\]'"
    with pytest.raises(ImportError, match=rf"d\.parquet needs pyarrow.*{fix}"):
        _load(tokenizer, path)


def test_directory_errors(tmp_path, tokenizer):
    need("pyarrow")
    plain = tmp_path / "plain"
    plain.mkdir()
    with pytest.raises(ValueError, match="not one written by datasets' save_to_disk"):
        _load(tokenizer, plain)
    (tmp_path / "dd" / "train").mkdir(parents=True)
    (tmp_path / "dd" / "dataset_dict.json").write_text('{"splits": ["train"]}')
    with pytest.raises(ValueError, match=r"DatasetDict \(splits \['train'\]\).*dd/train"):
        _load(tokenizer, tmp_path / "dd")
    (tmp_path / "junk.arrow").write_bytes(b"not arrow at all")
    with pytest.raises(ValueError, match="neither an Arrow IPC stream"):
        _load(tokenizer, tmp_path / "junk.arrow")
