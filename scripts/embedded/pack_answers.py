"""Pack a drafter config's answer sets for a GPU machine: one xz-compressed tar holding, for every set named by the
config (`data` and `extra_train_data`), each record's `id`, `prompt_ids` and `response_ids` alone. Training reads
those ids as they are, and without the texts the sets shrink a lot: round 25's six took 13.8 MB as full records in
gzip and 1.9 MB packed, round 26's ten 2.9 MB, well inside the 64 MiB that travel with the working tree.

    python scripts/embedded/pack_answers.py --config scripts/embedded/drafter_round26.yaml --out runs/gpu/answers.tgz

benchmarks/gpu_check.sh unpacks the archive into runs/embedded on the GPU machine.
"""

from __future__ import annotations

import argparse
import io
import json
import tarfile
from pathlib import Path

from dflash.errors import UserError
from dflash.records import read_jsonl
from dflash.training.config import load_config

KEPT = ("id", "prompt_ids", "response_ids")


def answer_sets(config: Path) -> list[Path]:
    """The config's answer files, read as `dflash train` reads them: `data`, then `extra_train_data`."""
    train = load_config(str(config), {})
    return [Path(train.data), *map(Path, train.extra_train_data or [])]


def slim(path: Path) -> bytes:
    """The file's records with only the token ids; a record without them stops the packing."""
    lines = []
    for n, record in read_jsonl(path, missing="make it with `dflash datagen` (the config names it)"):
        missing = [k for k in KEPT if k not in record]
        if missing:
            raise UserError(f"{path}:{n} has no {', '.join(missing)}: pack only sets written by `dflash datagen`")
        lines.append(json.dumps({k: record[k] for k in KEPT}, separators=(",", ":")) + "\n")
    return "".join(lines).encode()


def pack(config: Path, out: Path) -> None:
    """Write the archive; an archive already at `out` is replaced only once the new one is whole."""
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    with tarfile.open(partial, "w:xz") as tar:
        for path in answer_sets(config):
            data = slim(path)
            info = tarfile.TarInfo(path.name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
            print(f"{path}: {len(data.splitlines())} records")
    partial.replace(out)
    print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, required=True, help="drafter training config (YAML)")
    parser.add_argument("--out", type=Path, default=Path("runs/gpu/answers.tgz"))
    args = parser.parse_args()
    try:
        pack(args.config, args.out)
    except UserError as err:
        raise SystemExit(f"pack_answers.py: {err}") from None


if __name__ == "__main__":
    main()
