"""GPU benchmarks (``python -m flashguard.bench.kv | int4 | moderation``)."""

import json


def emit(table: str, data, out: str | None, json_path: str | None) -> None:
    """Print ``table`` and write it (``--out``) and ``data`` (``--json``) where asked."""
    print(table)
    if json_path:
        with open(json_path, "w") as fh:
            json.dump(data, fh, indent=1, default=str)
    if out:
        with open(out, "w") as fh:
            fh.write(table)
