"""`vllm-moa convert-official`: tell which authors' release a directory holds, the MoA authors'
(official.py) or the EAGLE-3 authors' (official_eagle3.py, by its config or its `midlayer.*`
tensors), and convert it into our drafter of that kind."""

from __future__ import annotations

from pathlib import Path

from vllm_moa.checkpoint.io import CONFIG_NAME
from vllm_moa.checkpoint.official import ConvertOptions, convert_moa_release
from vllm_moa.checkpoint.official_eagle3 import convert_eagle3_release, is_eagle3_release
from vllm_moa.checkpoint.release_files import read_json_object
from vllm_moa.kinds import BY_MODEL_TYPE


def convert_official(
    src: str | Path, dst: str | Path, options: ConvertOptions | None = None
) -> Path:
    """Convert the release in `src` (MoA: either layout; EAGLE-3) into a drafter directory."""
    opts = options or ConvertOptions()
    src = Path(src)
    if not src.is_dir():
        raise FileNotFoundError(f"source checkpoint directory {src} does not exist")
    if Path(dst).resolve() == src.resolve():
        raise ValueError(f"{dst} is the release's own directory: pass another output directory")
    file = src / CONFIG_NAME
    cfg = read_json_object(file) if file.is_file() else {}
    model_type = cfg.get("model_type")
    if isinstance(model_type, str) and model_type in BY_MODEL_TYPE:
        raise ValueError(
            f"{src} is already a vllm-moa drafter (model_type {model_type!r}): nothing to "
            "convert; pass it as --drafter as it is"
        )
    if not is_eagle3_release(src, cfg):
        return convert_moa_release(src, dst, opts)
    if opts.tli is not None:
        raise ValueError(
            f"{src} is an EAGLE-3 release: --tli is MoA's (an EAGLE-3 drafter finishes no "
            "draft through target layers); drop it"
        )
    return convert_eagle3_release(src, dst, opts.target)
