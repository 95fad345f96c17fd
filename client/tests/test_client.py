"""The client against a real fleet: `nomad up` (the built binaries: NOMAD_BIN_DIR, else the
workspace's target/debug) with an `mlp` tool, found as `nomad ps` finds it, called sync and
async, its failures raised with the gateway's codes, code run in its sandbox, its tools searched,
a task set run through it and its traces read back. The package is imported as installed
(`scripts/test` builds its wheel and installs that), so a file the wheel leaves out fails here.

    python -m unittest discover -s client/tests
"""

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import unittest
from pathlib import Path

from nomad_client import AsyncFleet, Fleet, FleetRun, RunFailed, ToolError, find_fleet

ROOT = Path(__file__).resolve().parents[2]

BIN = Path(os.environ.get("NOMAD_BIN_DIR", ROOT / "target" / "debug"))


def setUpModule():
    global DIR, UP, RUNS, STDERR
    for binary in ("nomad", "nomad-device-worker", "nomad-gateway", "nomad-scheduler"):
        if not (BIN / binary).is_file():
            raise RuntimeError(f"{BIN / binary} is missing: build first (cargo build --workspace --bins)")
    DIR = Path(tempfile.mkdtemp(prefix="nomad-client-"))
    subprocess.run(
        [BIN / "nomad-device-worker", "make-mlp", "--layers", "6,4", "--out", DIR / "mlp"],
        check=True, capture_output=True,
    )
    (DIR / "nomad.yml").write_text(f"tools:\n  - {{name: mlp, kind: mlp, source: {DIR / 'mlp'}}}\n")
    RUNS = DIR / "runs"
    STDERR = open(DIR / "up.stderr", "w")
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "NOMAD_OTEL_RUN_ID": "client-test"}
    UP = subprocess.Popen(
        [BIN / "nomad", "up", "--config", DIR / "nomad.yml", "--runs-dir", RUNS],
        env=env, stdout=subprocess.DEVNULL, stderr=STDERR,
    )
    fleet = RUNS / "client-test" / "fleet.json"
    deadline = time.monotonic() + 120
    while not fleet.is_file():
        if UP.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the fleet did not start:\n{(DIR / 'up.stderr').read_text()}")
        time.sleep(0.1)


def tearDownModule():
    UP.send_signal(signal.SIGTERM)
    UP.wait(timeout=60)
    STDERR.close()
    shutil.rmtree(DIR, ignore_errors=True)


class SyncClient(unittest.TestCase):
    def test_the_running_fleet_is_found_and_its_tools_called(self):
        self.assertEqual(find_fleet(RUNS), RUNS / "client-test" / "fleet.json")
        with Fleet.latest(RUNS) as fleet:
            tools = {t["name"]: t for t in fleet.tools()}
            self.assertIn("mlp", tools)
            self.assertIn("get_model_card", tools)
            self.assertIn("input", json.dumps(tools["mlp"]["input_schema"]))
            # A built-in kind says what it answers with, and answers with that.
            self.assertEqual(tools["mlp"]["output_schema"]["required"], ["output", "shape"])
            answer = fleet.call("mlp", input=[0.5] * 6)
            self.assertEqual(answer["shape"], [4])
            self.assertEqual(set(answer), set(tools["mlp"]["output_schema"]["properties"]))
            self.assertEqual(len(answer["output"]), 4)
            # The same session serves the next call.
            self.assertEqual(fleet.call("mlp", input=[0.5] * 6), answer)

    def test_failures_are_raised_with_the_gateways_code(self):
        with Fleet.latest(RUNS) as fleet:
            with self.assertRaises(ToolError) as wrong:
                fleet.call("mlp", input=[0.5] * 5)
            self.assertEqual(wrong.exception.code, "INVALID_ARGUMENT", wrong.exception)
            self.assertIn("6", wrong.exception.message)
            with self.assertRaises(ToolError) as unknown:
                fleet.call("nope", text="x")
            self.assertEqual(unknown.exception.code, "NOT_FOUND", unknown.exception)
            self.assertIn("nope", unknown.exception.message)
            self.assertIn("mlp", unknown.exception.message)

    def test_a_wrong_or_missing_token_is_a_tool_error_with_the_servers_words(self):
        described = json.loads(find_fleet(RUNS).read_text())
        self.assertTrue(described.get("token"), "nomad up's fleet has a token")
        for token, words in [
            ("not-the-token", "the bearer token is not this fleet's token"),
            (None, "send the header `Authorization: Bearer <token>`"),
        ]:
            with Fleet(described["gateway_mcp"], described["tools_mcp"], token) as fleet:
                with self.assertRaises(ToolError) as refused:
                    fleet.call("mlp", input=[0.5] * 6)
                self.assertEqual(refused.exception.code, "UNAUTHENTICATED", refused.exception)
                self.assertIn(words, refused.exception.message)
                # Code mode's session is refused alike.
                with self.assertRaises(ToolError) as refused:
                    fleet.run("RESULT = 1")
                self.assertEqual(refused.exception.code, "UNAUTHENTICATED", refused.exception)

    def test_a_gateway_that_is_not_there_is_unavailable_naming_its_address(self):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            url = f"http://127.0.0.1:{probe.getsockname()[1]}/mcp"
        with Fleet(url, url, "t") as fleet:
            with self.assertRaises(ToolError) as refused:
                fleet.call("mlp", input=[0.5] * 6)
        self.assertEqual(refused.exception.code, "UNAVAILABLE", refused.exception)
        self.assertIn(url, refused.exception.message)

    def test_code_runs_in_the_sandbox_and_calls_tools(self):
        with Fleet.latest(RUNS) as fleet:
            run = fleet.run("from mcp_tools.nomad import mlp\nprint('hi')\nRESULT = mlp([0.5] * 6)['shape']")
            self.assertTrue(run.ok, run.error)
            self.assertEqual(run.result, [4])
            self.assertEqual(run.stdout, "hi\n")
            failed = fleet.run("raise ValueError('boom')")
            self.assertFalse(failed.ok)
            self.assertEqual(failed.status, "error")
            self.assertIn("ValueError: boom", failed.error)
            # The traceback is the code's own: its lines, none of the runner that ran it, in an
            # async run and through a tool call that failed too.
            nested = fleet.run(
                "from mcp_tools.nomad import mlp\n"
                "async def g():\n"
                "    mlp(text='not numbers')\n"
                "await g()\n"
            )
            self.assertFalse(nested.ok)
            self.assertIn('File "<code>", line 4, in <module>', nested.error)
            self.assertIn('File "<code>", line 3, in g', nested.error)
            self.assertNotIn("runner.py", nested.error)
            self.assertNotIn("asyncio", nested.error)

    def test_search_finds_the_tool(self):
        with Fleet.latest(RUNS) as fleet:
            found = fleet.search("mlp", limit=3)
            self.assertTrue(any(t["name"] == "mlp" for t in found), found)

    def test_a_fleet_file_that_is_not_one_is_refused_by_name(self):
        bad = DIR / "not-a-fleet.json"
        bad.write_text("{}")
        with self.assertRaises(ValueError) as refused:
            Fleet.from_file(bad)
        self.assertIn("gateway_mcp", str(refused.exception))
        with self.assertRaises(FileNotFoundError):
            find_fleet(DIR / "nowhere")


class Runs(unittest.TestCase):
    def test_a_task_set_runs_through_the_fleet_and_its_traces_are_read_back(self):
        run = FleetRun.latest(RUNS)
        self.assertEqual(run.run_id, "client-test")
        tasks = [{"id": f"t{i}", "tool": "mlp", "arguments": {"input": [i / 10] * 6}} for i in range(3)]
        tasks.append({"id": "bad", "tool": "mlp", "arguments": {"input": [0.5] * 5}})
        results = {r["task_id"]: r for r in run.run_tasks(tasks, concurrency=2, nomad=BIN / "nomad")}
        self.assertEqual(set(results), {"t0", "t1", "t2", "bad"})
        for i in range(3):
            self.assertEqual(results[f"t{i}"]["status"], "ok", results[f"t{i}"])
            self.assertEqual(results[f"t{i}"]["output"]["shape"], [4])
            self.assertEqual(results[f"t{i}"]["run_id"], "client-test")
        # A rollout that failed is a result that says why, not an exception.
        self.assertEqual(results["bad"]["status"], "error")
        self.assertIn("6", results["bad"]["error"])
        # The rollout's trace, from its start to the scheduler's request, is in the run directory.
        trace = results["t1"]["trace_id"]
        self.assertTrue(trace)
        deadline = time.monotonic() + 30
        while True:
            spans = run.spans(trace_id=trace)
            names = {s["name"] for s in spans}
            if {"nomad.rollout", "nomad.tool.request"} <= names or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        self.assertLessEqual({"nomad.rollout", "nomad.tool.request"}, names)
        self.assertTrue(all(s["trace_id"] == trace for s in spans))
        # `nomad up` itself ran no task set here.
        self.assertEqual(run.results(), [])

    def test_a_task_set_nomad_cannot_run_is_refused_with_its_words(self):
        with self.assertRaises(RunFailed) as failed:
            list(FleetRun.latest(RUNS).run_tasks([{"id": "x"}], nomad=BIN / "nomad"))
        self.assertIn(":1", str(failed.exception))
        with self.assertRaises(ValueError):
            FleetRun(DIR / "nomad.yml")


class AsyncClient(unittest.TestCase):
    def test_concurrent_calls_on_one_client(self):
        async def main():
            async with AsyncFleet.latest(RUNS) as fleet:
                answers = await asyncio.gather(*(fleet.call("mlp", input=[i / 10] * 6) for i in range(16)))
                run = await fleet.run("RESULT = 6 * 7")
                return answers, run

        answers, run = asyncio.run(main())
        self.assertEqual(len(answers), 16)
        self.assertTrue(all(a["shape"] == [4] for a in answers))
        self.assertNotEqual(answers[0]["output"], answers[15]["output"])
        self.assertEqual(run.result, 42)


if __name__ == "__main__":
    unittest.main()
