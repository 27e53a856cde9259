"""Write the vLLM source files the plugin relies on (every path in
vllm_plugin/compat/symbols.py that the release must have) from a release's wheel into a small zip
the tests check offline.

    python scripts/extract_vllm_sources.py WHEEL tests/data/vllm_sources/vllm-0.33.0-src.zip

0.33.0 and 0.34.0 have no CPU build, so their source is checked, not run
(tests/test_vllm_release_symbols.py); a zip (~0.5 MB) spares CI a 240-340 MB download at test
time. Run it again after adding a symbol
in a file the zip lacks (the test says so). vLLM is Apache-2.0 licensed; the files are copied
unchanged.
"""

from __future__ import annotations

import argparse
import zipfile
from pathlib import Path

from vllm_moa.vllm_plugin.compat.source_check import Source, wanted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("wheel", type=Path, help="vllm-<version>-*.whl")
    parser.add_argument("out", type=Path, help="vllm-<version>-src.zip")
    args = parser.parse_args()
    paths = sorted({s.path for s in wanted(Source(args.wheel).version())})
    with zipfile.ZipFile(args.wheel) as wheel:
        names = set(wheel.namelist())
        missing = [p for p in paths if p not in names]
        if missing:
            raise SystemExit(f"{args.wheel.name} lacks {missing}")
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(args.out, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as out:
            for path in paths:
                info = zipfile.ZipInfo(path, date_time=(2020, 1, 1, 0, 0, 0))  # reproducible
                out.writestr(info, wheel.read(path), zipfile.ZIP_DEFLATED)
    print(f"wrote {len(paths)} files to {args.out} ({args.out.stat().st_size / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
