"""The records of one `--data` path, in file order.

- `.jsonl`/`.json`, optionally `.gz`: one JSON object a line (errors name `file:line`).
- `.parquet`; `.arrow` (Arrow IPC stream, as Hugging Face `datasets` writes it) or `.arrow`/
  `.feather` in the Arrow IPC file format (Feather v2): each row one record (errors name
  `file row i`, counted from 0 across the file). Needs pyarrow (`pip install 'vllm-moa[data]'`).
- A directory written by `datasets`' `save_to_disk` (`data-*.arrow` beside `state.json` or
  `dataset_info.json`): its Arrow files in the order `state.json` lists them.
- Any other file: plain text, one `Text` record.

Each JSON object or row may be in any layout `records.parse_record` reads.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

from vllm_moa.training.records import Record, Text, parse_record

ARROW_SUFFIXES = (".parquet", ".arrow", ".feather")
BATCH_ROWS = 1024  # rows converted to Python at a time


def read_records(path: Path) -> Iterator[Record]:
    for file in _files(path):
        if file.suffix in ARROW_SUFFIXES:
            for i, row in enumerate(_table_rows(file)):
                yield parse_record(row, f"{file} row {i}")
        elif file.name.removesuffix(".gz").endswith((".jsonl", ".json")):
            yield from _jsonl_records(file)
        else:
            yield Text("".join(read_lines(file)))


def _files(path: Path) -> list[Path]:
    """`path` itself, or the Arrow shards of a `save_to_disk` directory."""
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise FileNotFoundError(f"data file {path} does not exist")
    if (path / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in path.iterdir() if p.is_dir())
        raise ValueError(
            f"{path} holds a DatasetDict (splits {splits}): give one split's directory, "
            f"e.g. {path / (splits[0] if splits else 'train')}"
        )
    state = path / "state.json"
    if state.is_file():
        return [path / f["filename"] for f in json.loads(state.read_text())["_data_files"]]
    shards = sorted(path.glob("data-*.arrow"))
    if not shards or not (path / "dataset_info.json").is_file():
        raise ValueError(
            f"data path {path} is a directory but not one written by datasets' save_to_disk "
            "(data-*.arrow beside state.json or dataset_info.json); give the data files instead"
        )
    return shards


def read_lines(path: Path) -> Iterator[str]:
    """The lines of a text file, gzip-compressed where its name ends in .gz."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        yield from f


def read_jsonl(path: Path) -> Iterator[tuple[int, Any]]:
    """(line number from 1, value) of each non-blank line of a JSON-lines file (gzip or not);
    a line that is not JSON raises ValueError naming the file and line."""
    for n, line in enumerate(read_lines(path), 1):
        if not line.strip():
            continue
        try:
            yield n, json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n} is not valid JSON: {e}") from None


def _jsonl_records(path: Path) -> Iterator[Record]:
    for n, record in read_jsonl(path):
        yield parse_record(record, f"{path}:{n}")


def _pyarrow(path: Path) -> ModuleType:
    try:
        import pyarrow
    except ImportError:
        raise ImportError(
            f"reading {path} needs pyarrow, an optional dependency: pip install 'vllm-moa[data]'"
        ) from None
    return pyarrow


def _table_rows(path: Path) -> Iterator[dict[str, Any]]:
    """Rows of a Parquet file, an Arrow IPC stream or an Arrow IPC file, as Python dicts."""
    pa = _pyarrow(path)
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        for batch in pq.ParquetFile(path).iter_batches(batch_size=BATCH_ROWS):
            yield from batch.to_pylist()
        return
    with pa.memory_map(str(path)) as source:
        try:
            table = pa.ipc.open_stream(source).read_all()
        except pa.ArrowInvalid:
            try:
                table = pa.ipc.open_file(source).read_all()
            except pa.ArrowInvalid:
                raise ValueError(
                    f"{path} is neither an Arrow IPC stream (as datasets writes .arrow files) "
                    "nor an Arrow IPC file (Feather v2)"
                ) from None
        for batch in table.to_batches(max_chunksize=BATCH_ROWS):
            yield from batch.to_pylist()
