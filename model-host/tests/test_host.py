"""The model host as the device worker drives it: a real host process on a socket pair, speaking
length-prefixed JSON frames. Run with an interpreter that has pydantic:
`python -m unittest discover model-host/tests`."""

import json
import os
import socket
import struct
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
HOST = os.path.join(HERE, "..", "nomad_model_host.py")
FIXTURES = os.path.join(HERE, "fixtures")
# The worker writes `nomad_frame.py` beside the host; here it is imported from its own folder.
FRAME_MODULE = os.path.join(HERE, "..", "..", "shared", "frame")
# The frame limit the worker would declare; the host is told it, as by the worker.
LIMIT = 64 << 20


class Host:
    def __init__(self, path=FIXTURES, limit=LIMIT):
        ours, theirs = socket.socketpair()
        env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        env.update(
            NOMAD_HOST_FD=str(theirs.fileno()),
            NOMAD_HOST_PATH=path,
            NOMAD_HOST_MAX_FRAME=str(limit),
            PYTHONPATH=FRAME_MODULE,
        )
        self.process = subprocess.Popen(
            [sys.executable, "-u", HOST],
            env=env,
            pass_fds=[theirs.fileno()],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        theirs.close()
        self.sock = ours
        self.sock.settimeout(30)
        self.reader = ours.makefile("rb")

    def call(self, request: dict):
        payload = json.dumps(request).encode()
        self.sock.sendall(struct.pack(">I", len(payload)) + payload)
        header = self.reader.read(4)
        if len(header) < 4:
            return None
        (length,) = struct.unpack(">I", header)
        return json.loads(self.reader.read(length))

    def close(self):
        self.reader.close()
        self.sock.close()
        out, err = self.process.communicate(timeout=30)
        return self.process.returncode, out.decode(), err.decode()


class HostTests(unittest.TestCase):
    def setUp(self):
        self.weights = tempfile.mkdtemp()
        with open(os.path.join(self.weights, "factor.txt"), "w") as f:
            f.write("2.5")
        self.host = Host()

    def tearDown(self):
        if self.host.process.poll() is None:
            self.host.close()

    def load(self, target="toy_models.Doubler", entry="model_class", **extra):
        request = {"op": "load", "entry": entry, "target": target, "source": self.weights}
        request.update(extra)
        return self.host.call(request)

    def batch(self, *items):
        return self.host.call({"op": "batch", "items": list(items), "trace": {}})

    def test_a_class_is_described_from_the_class_alone(self):
        reply = self.load(instantiate=False)["ok"]
        self.assertFalse(reply["instantiated"])
        self.assertEqual(reply["batch_size"], 4)
        self.assertIn("values", reply["input_schema"]["properties"])
        self.assertIn("result", reply["output_schema"]["properties"])
        self.assertTrue(reply["description"].startswith("Multiplies values"))

    def test_a_class_that_needs_its_weights_to_say_what_it_takes_is_instantiated(self):
        reply = self.load(target="toy_models.Lazy", instantiate=False)["ok"]
        self.assertTrue(reply["instantiated"])
        self.assertEqual(reply["description"], "built by from_pretrained")

    def test_a_batch_answers_each_item_and_refuses_a_bad_one_by_its_field(self):
        self.load()
        reply = self.batch({"values": [1, 2]}, {"scale": 2}, {"values": [4], "scale": 2})["ok"]
        results = reply["results"]
        self.assertEqual(results[0], {"output": {"result": [2.5, 5.0], "batch": 2}})
        self.assertIn("values", results[1]["invalid"])
        self.assertEqual(results[2], {"output": {"result": [20.0], "batch": 2}})

    def test_an_item_that_raises_gets_its_error_and_its_batch_mates_are_answered(self):
        self.load()
        results = self.batch({"values": [1]}, {"values": [1], "scale": 13}, {"values": [2]})["ok"][
            "results"
        ]
        self.assertEqual(results[0]["output"]["result"], [2.5])
        self.assertIn("ValueError: scale 13 is unlucky", results[1]["error"])
        self.assertEqual(results[2]["output"]["result"], [5.0])

    def test_out_of_memory_is_reported_as_such(self):
        self.load()
        reply = self.batch({"values": [1], "scale": 7}, {"values": [1]}, {"values": [1]})
        self.assertEqual(reply["error"]["kind"], "out_of_memory")
        self.assertIn("CUDA out of memory", reply["error"]["message"])
        # Halved below the size that fails, the same items are served.
        results = self.batch({"values": [1], "scale": 7}, {"values": [1]})["ok"]["results"]
        self.assertEqual(results[0]["output"]["result"], [17.5])

    def test_printing_model_code_leaves_the_protocol_intact(self):
        self.load()
        for _ in range(3):
            self.assertIn("ok", self.batch({"values": [1]}))
        code, out, _ = self.host.close()
        self.assertEqual(code, 0)
        self.assertEqual(out.count("forward of 1"), 3)

    def test_a_host_that_dies_under_a_batch_closes_its_socket(self):
        self.load()
        self.assertIsNone(self.batch({"values": [1], "scale": 99}))
        self.assertEqual(self.host.process.wait(timeout=30), 3)

    def test_callables_validate_their_arguments_and_run_per_item(self):
        reply = self.load(target="toy_models.add", entry="callable")["ok"]
        self.assertEqual(reply["input_schema"]["required"], ["a"])
        self.assertEqual(reply["output_schema"], {"type": "integer"})
        self.assertEqual(reply["description"], "Adds two integers.")
        results = self.batch({"a": 2, "b": 3}, {"a": "x"}, {"a": 4})["ok"]["results"]
        self.assertEqual(results[0], {"output": 5})
        self.assertIn("a", results[1]["invalid"])
        self.assertEqual(results[2], {"output": 5})

    def test_a_factory_is_called_with_its_keyword_arguments(self):
        self.load(target="toy_models.make_scaler", entry="callable", tool_kwargs={"factor": 3})
        self.assertEqual(self.batch({"x": 2})["ok"]["results"], [{"output": 6.0}])

    def test_an_async_callable_is_awaited(self):
        self.load(target="toy_models.shout", entry="callable")
        self.assertEqual(self.batch({"text": "hi"})["ok"]["results"], [{"output": "HI"}])

    def test_bad_requests_are_refused_by_name(self):
        self.assertEqual(self.batch({"values": [1]})["error"]["kind"], "bad_request")
        self.assertIn("unknown op", self.host.call({"op": "nope"})["error"]["message"])
        missing = self.load(target="toy_models.Nothing")["error"]
        self.assertIn("has no 'Nothing'", missing["message"])
        unimportable = self.load(target="no_such_package.Model")["error"]
        self.assertIn("cannot import 'no_such_package'", unimportable["message"])
        self.assertIn("`env`", unimportable["message"])

    def test_a_frame_over_the_limit_is_refused_without_reading_it(self):
        self.host.sock.sendall(struct.pack(">I", LIMIT + 1))
        header = self.host.reader.read(4)
        (length,) = struct.unpack(">I", header)
        reply = json.loads(self.host.reader.read(length))
        self.assertEqual(reply["error"]["kind"], "bad_request")
        self.assertEqual(reply["error"]["message"], f"frame of {LIMIT + 1} bytes exceeds the {LIMIT}-byte limit")
        self.assertEqual(self.host.process.wait(timeout=30), 0)


class PlainHostTests(unittest.TestCase):
    """An environment without pydantic: schemas from plain annotations, arguments bound to the
    signature."""

    def test_a_callable_is_described_and_called_from_its_annotations(self):
        host = Host(os.pathsep.join([os.path.join(FIXTURES, "no_pydantic"), FIXTURES]))
        try:
            reply = host.call({"op": "load", "entry": "callable", "target": "plain_tools.scale"})["ok"]
            self.assertEqual(reply["input_schema"]["properties"]["x"], {"type": "number"})
            self.assertEqual(reply["input_schema"]["properties"]["k"], {"type": "integer", "default": 2})
            self.assertEqual(reply["input_schema"]["required"], ["x"])
            self.assertEqual(reply["output_schema"], {"type": "number"})
            results = host.call({"op": "batch", "items": [{"x": 1.5}, {"k": 3}, {"x": 1, "y": 2}],
                                 "trace": {}})["ok"]["results"]
            self.assertEqual(results[0], {"output": 3.0})
            self.assertIn("x: Field required", results[1]["invalid"])
            self.assertIn("y: Extra inputs are not permitted", results[2]["invalid"])
        finally:
            host.close()

    def test_a_reply_over_the_limit_is_answered_as_a_failure_that_says_what_to_do(self):
        host = Host(os.pathsep.join([os.path.join(FIXTURES, "no_pydantic"), FIXTURES]), limit=1000)
        try:
            self.assertIn("ok", host.call({"op": "load", "entry": "callable", "target": "plain_tools.scale"}))
            # 80 items fit the request; their 80 outputs do not fit the reply.
            reply = host.call({"op": "batch", "items": [{"x": 1.5}] * 80, "trace": {}})
            self.assertEqual(reply["error"]["kind"], "failed")
            self.assertRegex(
                reply["error"]["message"],
                r"^the reply: frame of \d+ bytes exceeds the 1000-byte limit: return smaller outputs",
            )
            self.assertEqual(len(host.call({"op": "batch", "items": [{"x": 1}], "trace": {}})["ok"]["results"]), 1)
        finally:
            host.close()

    def test_a_host_not_told_its_frame_limit_says_who_tells_it(self):
        env = dict(os.environ, NOMAD_HOST_FD="3", PYTHONPATH=FRAME_MODULE)
        env.pop("NOMAD_HOST_MAX_FRAME", None)
        done = subprocess.run([sys.executable, HOST], env=env, capture_output=True, text=True, timeout=30)
        self.assertEqual(done.returncode, 2)
        self.assertIn("NOMAD_HOST_MAX_FRAME is '', not a number of bytes", done.stderr)

    def test_arguments_are_checked_against_the_declared_schema_without_pydantic(self):
        host = Host(os.pathsep.join([os.path.join(FIXTURES, "no_pydantic"), FIXTURES]))
        try:
            reply = host.call({"op": "load", "entry": "callable", "target": "plain_tools.norm"})["ok"]
            properties = reply["input_schema"]["properties"]
            self.assertEqual(properties["values"], {"type": "array", "items": {"type": "number"}})
            self.assertEqual(properties["weights"]["anyOf"],
                             [{"type": "object", "additionalProperties": {"type": "number"}},
                              {"type": "null"}])
            results = host.call({"op": "batch", "trace": {}, "items": [
                {"values": [3, 4]},
                {"values": "abc"},
                {"values": [1, "two"]},
                {"values": [1], "weights": {"a": "heavy"}},
                {"values": [1], "mode": 3},
            ]})["ok"]["results"]
            self.assertEqual(results[0], {"output": 5.0})
            self.assertIn("values: expected array, got str 'abc'", results[1]["invalid"])
            self.assertIn("values.1: expected number, got str 'two'", results[2]["invalid"])
            self.assertIn("weights: matches none of the allowed forms", results[3]["invalid"])
            self.assertIn("mode: expected string, got int 3", results[4]["invalid"])

            # A model class's own JSON Schema object: its bounds hold too.
            loaded = host.call({"op": "load", "entry": "model_class", "target": "plain_tools.Bounded",
                                "source": FIXTURES})
            self.assertIn("ok", loaded, loaded)
            results = host.call({"op": "batch", "trace": {}, "items": [
                {"values": [1, 2]}, {"values": []}, {"values": [1, 2, 3, 4]}, {"values": [1], "x": 1},
            ]})["ok"]["results"]
            self.assertEqual(results[0], {"output": 3})
            self.assertIn("values: at least 1 items, got 0", results[1]["invalid"])
            self.assertIn("values: at most 3 items, got 4", results[2]["invalid"])
            self.assertIn("x: Extra inputs are not permitted", results[3]["invalid"])
        finally:
            host.close()


if __name__ == "__main__":
    unittest.main()
