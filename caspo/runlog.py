"""What a run writes as it goes: metrics.jsonl (one line a step), samples.jsonl (one line a sample)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

console = Console(stderr=True)


class JsonlWriter:
    def __init__(self, path: Path, truncate_after_step: int | None = None,
                 drop: Callable[[dict], bool] | None = None):
        """Append to `path`; on resume, first drop lines of steps after `truncate_after_step`
        and lines for which `drop(record)` holds (records the resumed run writes again)."""
        self.path = path
        if truncate_after_step is not None and path.exists():
            def kept(record: dict) -> bool:
                return record.get("step", -1) <= truncate_after_step and not (drop and drop(record))

            keep = [line for line in path.read_text().splitlines() if line and kept(json.loads(line))]
            path.write_text("".join(line + "\n" for line in keep))
        self.file = path.open("a")

    def write(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def progress_bar() -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        TextColumn("{task.fields[status]}"), console=console, transient=False,
    )
