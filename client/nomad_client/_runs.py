"""A fleet's run, on disk: run task sets through the fleet as rollouts (`nomad run --fleet`) and
follow their results as they come, and read back what the run recorded (its results and spans,
from the run directory `nomad up` writes, `runs/<run id>/`)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Iterable, Iterator

from ._client import find_fleet


class RunFailed(RuntimeError):
    """`nomad run` could not run the task set (a bad task, a fleet that stopped): its own words."""


class FleetRun:
    """The run of a fleet that `nomad up` started, found by its `fleet.json`.

        run = FleetRun.latest()
        for result in run.run_tasks([{"id": "a", "tool": "embed", "arguments": {"text": "hi"}}]):
            print(result["status"], result["trace_id"])
        spans = run.spans(trace_id=result["trace_id"])     # the rollout's whole trace
    """

    def __init__(self, fleet_file: str | os.PathLike):
        self.fleet_file = Path(fleet_file)
        fleet = json.loads(self.fleet_file.read_text())
        if "run_id" not in fleet:
            raise ValueError(f"{self.fleet_file} has no run_id: is it a fleet.json of `nomad up`?")
        self.run_id: str = fleet["run_id"]
        self.directory = self.fleet_file.parent

    @classmethod
    def latest(cls, runs_dir: str | os.PathLike = "runs") -> "FleetRun":
        """The newest fleet still running under `runs_dir`."""
        return cls(find_fleet(runs_dir))

    def run_tasks(self, tasks: Iterable[dict], concurrency: int = 8,
                  nomad: str | os.PathLike | None = None) -> Iterator[dict]:
        """Runs `tasks` (each as a line of a tasks file: `{"id", "code"}` or `{"id", "tool",
        "arguments"}`, with `expected` and `verify` to verify) through the fleet, `concurrency`
        at a time, and yields each rollout's result as it ends (in the order they end). The
        rollouts' spans go to the run directory, so `spans()` and `nomad traces` find them.

        `nomad` is the program to run (default: `$NOMAD_BIN`, else `nomad` on PATH). Raises
        `RunFailed` with nomad's message when it cannot run the set; a rollout that fails is a
        result with status `error`, not an exception."""
        program = str(nomad or os.environ.get("NOMAD_BIN") or shutil.which("nomad") or "")
        if not program:
            raise FileNotFoundError("no `nomad` program: put it on PATH, set NOMAD_BIN, or pass nomad=")
        with tempfile.NamedTemporaryFile("w", suffix=".jsonl", prefix="nomad-tasks-") as file:
            for task in tasks:
                file.write(json.dumps(task) + "\n")
            file.flush()
            command = [program, "run", "--fleet", str(self.fleet_file), "--tasks", file.name,
                       "--out", "-", "--concurrency", str(concurrency)]
            with tempfile.TemporaryFile("w+") as stderr:
                with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, text=True) as child:
                    results = 0
                    for line in child.stdout:
                        if line.strip():
                            results += 1
                            yield json.loads(line)
                    child.wait()
                stderr.seek(0)
                said = stderr.read().strip()
        # Exit 1 with results: some rollouts failed, and their results say why.
        if child.returncode != 0 and not (child.returncode == 1 and results > 0):
            raise RunFailed(f"nomad run exited with {child.returncode}: {said.splitlines()[-1] if said else ''}")

    def results(self) -> list[dict]:
        """The results of the task set `nomad up --tasks` (or `--demo`) ran, in the order they
        ended (`results.jsonl`; empty when it ran none)."""
        path = self.directory / "results.jsonl"
        if not path.is_file():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def spans(self, trace_id: str | None = None) -> list[dict]:
        """Every span the run's processes wrote to its directory (console export, `nomad up`'s
        default), as JSON objects with `name`, `trace_id`, `span_id`, `parent_span_id`,
        `start_time_unix_nano`, `end_time_unix_nano`, `status` and `attributes`; only those of
        `trace_id` when given (one rollout's trace). Spans are exported in batches, so the last
        ones of a rollout arrive a moment after its result."""
        spans = []
        for path in sorted(self.directory.glob("*.jsonl")):
            for line in path.read_text(errors="replace").splitlines():
                if '"signal":"span"' not in line:
                    continue
                try:
                    span = json.loads(line)
                except ValueError:  # a line a killed process left half-written
                    continue
                if trace_id is None or span.get("trace_id") == trace_id:
                    spans.append(span)
        return spans
