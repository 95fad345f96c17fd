"""Nomad's model host: serves one Python model to the device worker that started it.

The worker starts this file with the model's own interpreter (its cached environment) and hands
it one end of a socket pair as the file descriptor named by ``NOMAD_HOST_FD``. Requests and
replies are Nomad's frames on that socket (``nomad_frame``, which the worker writes beside this
file), each a UTF-8 JSON object of at most ``NOMAD_HOST_MAX_FRAME`` bytes, a limit the worker
declares and sets. The model's own ``print`` goes to stdout, which the worker logs; it can never
reach the protocol.

A model is either

- a class in the shape of ``nomad.fm_base_tool.TorchModuleTool`` (``from_pretrained``,
  ``args_schema``, ``output_schema``, ``preprocess``, ``_forward``, ``postprocess``,
  ``batch_size``, ``description``), or any class with those members; or
- a plain callable (or a factory of one, given ``tool_kwargs``), called once per item.

Standard library only: pydantic, torch and numpy come from the model's environment when the model
uses them.

Requests (``op``) and their replies (``{"ok": {...}}``, or ``{"error": {"kind": "out_of_memory" |
"failed" | "bad_request", "message": "..."}}``):

- ``load``: ``entry`` ("model_class" or "callable"), ``target`` (dotted path), ``source`` (the
  resolved ``name_or_path``), ``tool_kwargs``, ``instantiate`` (false: describe from the class
  alone when it can), ``device`` → ``name``, ``description``, ``input_schema``,
  ``output_schema``, ``batch_size``, ``bytes``, ``instantiated``.
- ``batch``: ``items`` (one JSON object each), ``trace`` (W3C fields) → ``results``: one
  ``{"output": ...}``, ``{"invalid": "..."}`` (the arguments failed
  validation) or ``{"error": "..."}`` (the model raised on that item alone) per item, in order.
- ``to``: ``device`` ("cpu" or "cuda") → moves the model (offload / place).
- ``clear_cache`` → ``released_bytes`` (device memory in use is the driver's figure, which the
  worker reports for every process on its GPU, hosts included).
- ``exit``: replies, then the host exits.
"""

from __future__ import annotations

import asyncio
import gc
import importlib
import inspect
import json
import os
import pkgutil
import socket
import sys
import traceback

import nomad_frame

PROTOCOL_VERSION = 1


class HostError(Exception):
    """A failure reported to the worker with its kind."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def failed(message: str) -> HostError:
    return HostError("failed", message)


# --- framing -----------------------------------------------------------------------------------


class Channel:
    """The protocol socket: one frame in, one frame out, each at most `limit` bytes: the worker
    sends nothing larger, and a reply that would be larger is answered as a failure instead."""

    def __init__(self, fd: int, limit: int):
        os.set_inheritable(fd, False)  # subprocesses of the model never get the protocol
        self.sock = socket.socket(fileno=fd)
        self.reader = self.sock.makefile("rb")
        self.limit = limit

    def _read_exact(self, n: int) -> bytes:
        data = self.reader.read(n)
        if len(data) < n:
            raise EOFError
        return data

    def receive(self):
        try:
            return json.loads(nomad_frame.read(self._read_exact, self.limit))
        except EOFError:
            return None  # the worker is gone
        except nomad_frame.FrameTooLarge as e:
            raise HostError("bad_request", str(e)) from None

    def send(self, reply: dict) -> None:
        payload = json.dumps(reply, separators=(",", ":"), allow_nan=False).encode()
        try:
            frame = nomad_frame.pack(payload, self.limit)
        except nomad_frame.FrameTooLarge as e:
            message = f"the reply: {e}: return smaller outputs or lower the batch size"
            frame = nomad_frame.pack(json.dumps(error_reply(failed(message))).encode(), self.limit)
        self.sock.sendall(frame)


def error_reply(error: HostError) -> dict:
    return {"error": {"kind": error.kind, "message": str(error)}}


# --- symbols ------------------------------------------------------------------------


def resolve_symbol(dotted: str):
    """`package.module.Name`; a name missing from a package is searched for in its modules, as
    the original does."""
    module_path, _, attr = dotted.rpartition(".")
    if not module_path:
        raise failed(f"{dotted!r} is not a dotted path (package.module.Name)")
    try:
        module = importlib.import_module(module_path)
    except ImportError as e:
        raise failed(
            f"cannot import {module_path!r} for {dotted!r}: {e} (is the package in the tool's "
            "`env`?)"
        ) from e
    found = _search(module, attr, set())
    if found is None:
        raise failed(f"module {module_path!r} has no {attr!r}")
    return found


def _search(module, attr: str, seen: set):
    if module.__name__ in seen:
        return None
    seen.add(module.__name__)
    if hasattr(module, attr):
        return getattr(module, attr)
    for _, child, _ in pkgutil.iter_modules(getattr(module, "__path__", [])):
        if child.startswith("_"):
            continue
        try:
            found = _search(importlib.import_module(f"{module.__name__}.{child}"), attr, seen)
        except Exception:
            continue
        if found is not None:
            return found
    return None


# --- optional libraries -----------------------------------------------------------------------


def optional(name: str):
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def torch_module():
    # Only a model that imported torch uses it; importing it here would cost a callable seconds.
    return sys.modules.get("torch")


def is_out_of_memory(exc: BaseException) -> bool:
    torch = torch_module()
    oom = getattr(torch, "OutOfMemoryError", None) if torch else None
    if oom is not None and isinstance(exc, oom):
        return True
    if type(exc).__name__ == "OutOfMemoryError" or isinstance(exc, MemoryError):
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


def exception_text(exc: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(exc), exc)).strip()


def validation_text(exc: BaseException) -> str:
    """A pydantic ValidationError as `field.path: message; ...`; anything else as its text."""
    if isinstance(exc, InvalidArguments):
        return str(exc)
    errors = getattr(exc, "errors", None)
    if callable(errors):
        try:
            parts = []
            for e in errors():
                where = ".".join(str(p) for p in e.get("loc", ())) or "(arguments)"
                parts.append(f"{where}: {e.get('msg', 'invalid')}")
            if parts:
                return "; ".join(parts)
        except Exception:
            pass
    return exception_text(exc)


def schema_of(model) -> dict | None:
    if model is None:
        return None
    if hasattr(model, "model_json_schema"):
        return model.model_json_schema()
    if isinstance(model, dict):
        return model
    raise failed(f"{model!r} is not a pydantic model class or a JSON Schema object")


def to_json(value):
    """A JSON-ready copy of an output (pydantic models, tensors and arrays included)."""
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json")
    if isinstance(value, dict):
        return {str(k): to_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json(v) for v in value]
    if hasattr(value, "tolist"):  # numpy arrays and scalars, torch tensors
        return value.tolist()
    core = optional("pydantic_core")
    if core is not None:
        return core.to_jsonable_python(value)
    return value


class InvalidArguments(ValueError):
    """Arguments that do not fit the tool's JSON Schema; the message names each field."""


# JSON Schema's types, as Python values (a bool is not a number, as JSON has it).
_JSON_TYPES = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool)
    or isinstance(v, float) and v.is_integer(),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
}


def schema_errors(value, schema, where: str, root: dict, depth: int = 0) -> list:
    """Where `value` breaks `schema` (the keywords tools' schemas use: types, enum and const,
    anyOf/oneOf/allOf, `$ref` into `$defs`, items and prefixItems, properties, required and
    additionalProperties, the bounds on numbers, lengths and counts), as `where: why` lines.
    Keywords it does not know are not checked, nor anything deeper than 64 levels (a `$ref`
    that refers to itself ends there)."""
    if not isinstance(schema, dict) or depth > 64:
        return []
    depth += 1
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/"):
        target = root
        for part in ref[2:].split("/"):
            target = target.get(part, {}) if isinstance(target, dict) else {}
        return schema_errors(value, target, where, root, depth)
    at = where or "(arguments)"
    kinds = schema.get("type")
    if kinds is not None:
        kinds = kinds if isinstance(kinds, list) else [kinds]
        if not any(_JSON_TYPES.get(k, lambda v: True)(value) for k in kinds):
            return [f"{at}: expected {' or '.join(kinds)}, got {type(value).__name__} {value!r:.60}"]
    if "enum" in schema and value not in schema["enum"]:
        return [f"{at}: expected one of {schema['enum']!r:.120}"]
    if "const" in schema and value != schema["const"]:
        return [f"{at}: expected {schema['const']!r:.60}"]
    for keyword in ("anyOf", "oneOf"):
        options = schema.get(keyword)
        if isinstance(options, list) and options:
            if all(schema_errors(value, o, where, root, depth) for o in options):
                return [f"{at}: matches none of the allowed forms"]
    errors = []
    for part in schema.get("allOf") or []:
        errors += schema_errors(value, part, where, root, depth)
    bounds = [("minimum", lambda v, b: v >= b, ">="), ("maximum", lambda v, b: v <= b, "<="),
              ("exclusiveMinimum", lambda v, b: v > b, ">"),
              ("exclusiveMaximum", lambda v, b: v < b, "<")]
    if _JSON_TYPES["number"](value):
        for keyword, holds, sign in bounds:
            bound = schema.get(keyword)
            if isinstance(bound, (int, float)) and not holds(value, bound):
                errors.append(f"{at}: must be {sign} {bound}")
    if isinstance(value, (str, list, dict)):
        noun = {str: "characters", list: "items", dict: "properties"}[type(value)]
        low, high = {str: ("minLength", "maxLength"), list: ("minItems", "maxItems"),
                     dict: ("minProperties", "maxProperties")}[type(value)]
        if isinstance(schema.get(low), int) and len(value) < schema[low]:
            errors.append(f"{at}: at least {schema[low]} {noun}, got {len(value)}")
        if isinstance(schema.get(high), int) and len(value) > schema[high]:
            errors.append(f"{at}: at most {schema[high]} {noun}, got {len(value)}")
    if isinstance(value, list):
        prefix = schema.get("prefixItems") or []
        for i, item in enumerate(value):
            part = prefix[i] if i < len(prefix) else schema.get("items")
            errors += schema_errors(item, part, f"{where}.{i}" if where else str(i), root, depth)
    if isinstance(value, dict):
        properties = schema.get("properties") or {}
        for key in schema.get("required") or []:
            if key not in value:
                errors.append(f"{where + '.' if where else ''}{key}: Field required")
        extra = schema.get("additionalProperties")
        for key, item in value.items():
            inner = f"{where}.{key}" if where else str(key)
            if key in properties:
                errors += schema_errors(item, properties[key], inner, root, depth)
            elif extra is False:
                errors.append(f"{inner}: Extra inputs are not permitted")
            elif isinstance(extra, dict):
                errors += schema_errors(item, extra, inner, root, depth)
    return errors


def check_object(item, schema: dict):
    """Arguments checked against a tool's JSON Schema by the host itself, whatever the model's
    environment holds: an object of the right fields, each of its declared form."""
    if not isinstance(item, dict):
        raise InvalidArguments("(arguments): the arguments must be a JSON object")
    errors = schema_errors(item, schema or {}, "", schema or {})
    if errors:
        raise InvalidArguments("; ".join(errors[:20]))
    return item


# --- models -----------------------------------------------------------------------------------


class ModelClass:
    """A TorchModuleTool-like class, served in batches."""

    def __init__(self, request: dict):
        self.cls = resolve_symbol(request["target"])
        self.source = request.get("source")
        self.tool = None
        if request.get("instantiate", True) or not self._described_by_class():
            self.instantiate()

    def _class_field(self, name: str):
        fields = getattr(self.cls, "model_fields", None)
        if isinstance(fields, dict) and name in fields:
            default = fields[name].default
            return None if type(default).__name__ == "PydanticUndefinedType" else default
        value = getattr(self.cls, name, None)
        return None if isinstance(value, property) else value

    def _described_by_class(self) -> bool:
        return all(self._class_field(f) is not None for f in ("description", "args_schema"))

    def instantiate(self) -> None:
        if not hasattr(self.cls, "from_pretrained"):
            raise failed(f"{self.cls.__qualname__} has no `from_pretrained` constructor")
        self.tool = self.cls.from_pretrained(str(self.source) if self.source else None)
        for member in ("args_schema", "preprocess", "_forward", "postprocess"):
            if not hasattr(self.tool, member):
                raise failed(f"{self.cls.__qualname__} instance has no `{member}`")

    def field(self, name: str):
        if self.tool is not None:
            return getattr(self.tool, name, None)
        return self._class_field(name)

    def describe(self) -> dict:
        batch_size = self.field("batch_size")
        return {
            "name": self.field("name") or self.cls.__name__,
            "description": self.field("description") or inspect.getdoc(self.cls) or "",
            "input_schema": schema_of(self.field("args_schema")),
            "output_schema": schema_of(self.field("output_schema")),
            "batch_size": int(batch_size) if isinstance(batch_size, int) and batch_size > 0 else 0,
            "bytes": parameter_bytes(getattr(self.tool, "fm", None)),
            "instantiated": self.tool is not None,
        }

    def run(self, items: list) -> list:
        args_schema = self.tool.args_schema
        results: list = [None] * len(items)
        valid = []
        for i, item in enumerate(items):
            try:
                if hasattr(args_schema, "model_validate"):
                    valid.append((i, args_schema.model_validate(item)))
                else:
                    valid.append((i, check_object(item, args_schema)))
            except Exception as e:
                results[i] = {"invalid": validation_text(e)}
        if not valid:
            return results
        try:
            outputs = self._forward([args for _, args in valid])
        except Exception as e:
            if is_out_of_memory(e) or isinstance(e, HostError):
                raise
            if len(valid) == 1:
                results[valid[0][0]] = {"error": exception_text(e)}
                return results
            # One item broke the batch: run each alone, so its batch-mates are answered and it
            # gets its own error.
            outputs = []
            for index, args in valid:
                try:
                    outputs.append(self._forward([args])[0])
                except Exception as alone:
                    if is_out_of_memory(alone) or isinstance(alone, HostError):
                        raise
                    results[index] = {"error": exception_text(alone)}
                    outputs.append(None)
        for (i, _), output in zip(valid, outputs):
            if results[i] is None:
                results[i] = {"output": self._dump(output)}
        return results

    def _forward(self, batch: list) -> list:
        torch = torch_module()
        mode = torch.inference_mode() if torch is not None else _nothing()
        with mode:
            outputs = list(self.tool.postprocess(self.tool._forward(self.tool.preprocess(batch))))
        if len(outputs) != len(batch):
            raise failed(f"postprocess gave {len(outputs)} outputs for {len(batch)} inputs")
        return outputs

    def _dump(self, output):
        schema = getattr(self.tool, "output_schema", None)
        if schema is not None and hasattr(schema, "model_validate") and not isinstance(
            output, schema
        ):
            output = schema.model_validate(output)
        return to_json(output)

    def to(self, device: str) -> None:
        if self.tool is None:
            return
        torch = torch_module()
        fm = getattr(self.tool, "fm", None)
        if fm is not None and hasattr(fm, "to"):
            target = torch.device(device) if torch is not None else device
            self.tool.fm = fm.to(target)
            if hasattr(self.tool, "device"):
                try:
                    self.tool.device = target
                except Exception:
                    pass
        elif hasattr(self.tool, "to"):
            self.tool.to(device)


class Function:
    """A plain function (or a factory's product), called once per item."""

    def __init__(self, request: dict):
        fn = resolve_symbol(request["target"])
        kwargs = request.get("tool_kwargs") or {}
        if kwargs:
            fn = fn(**kwargs)
        if not callable(fn):
            raise failed(f"{request['target']} is not callable")
        self.fn = fn
        # Annotations written as strings (`from __future__ import annotations`) are resolved,
        # so the schema has their types; a name that cannot be resolved leaves them as text.
        try:
            self.signature = inspect.signature(fn, eval_str=True)
        except Exception:
            self.signature = inspect.signature(fn)
        self.loop = None
        pydantic = optional("pydantic")
        self.arguments = None
        self.returns = None
        if pydantic is not None:
            self._pydantic_models(pydantic)
        # Without pydantic, the host checks arguments against the schema the annotations give.
        self.plain_input = plain_schema(self.signature)

    def _pydantic_models(self, pydantic) -> None:
        fields = {}
        for name, p in self.signature.parameters.items():
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                continue
            annotation = object if p.annotation is p.empty else p.annotation
            default = ... if p.default is p.empty else p.default
            fields[name] = (annotation, default)
        hints = getattr(self.fn, "__annotations__", {})
        name = getattr(self.fn, "__name__", type(self.fn).__name__)
        self.arguments = pydantic.create_model(f"{name}_arguments", **fields)
        if "return" in hints and self.signature.return_annotation is not inspect.Signature.empty:
            self.returns = pydantic.TypeAdapter(self.signature.return_annotation)

    def describe(self) -> dict:
        if self.arguments is not None:
            input_schema = self.arguments.model_json_schema()
        else:
            input_schema = plain_schema(self.signature)
        if self.returns is not None:
            output_schema = self.returns.json_schema()
        else:
            output_schema = plain_type(self.signature.return_annotation)
        return {
            "name": getattr(self.fn, "__name__", type(self.fn).__name__),
            "description": inspect.getdoc(self.fn) or "",
            "input_schema": input_schema,
            "output_schema": output_schema,
            "batch_size": 0,
            "bytes": 0,
            "instantiated": True,
        }

    def run(self, items: list) -> list:
        results = []
        for item in items:
            try:
                if self.arguments is not None:
                    validated = self.arguments.model_validate(item)
                    kwargs = {name: getattr(validated, name) for name in type(validated).model_fields}
                else:
                    check_object(item, self.plain_input)
                    self.signature.bind(**item)
                    kwargs = item
            except Exception as e:
                results.append({"invalid": validation_text(e)})
                continue
            try:
                value = self.fn(**kwargs)
                if inspect.isawaitable(value):
                    if self.loop is None:
                        self.loop = asyncio.new_event_loop()
                    value = self.loop.run_until_complete(value)
            except Exception as e:
                if is_out_of_memory(e):
                    raise
                results.append({"error": exception_text(e)})
                continue
            if self.returns is not None:
                value = self.returns.dump_python(value, mode="json")
            results.append({"output": to_json(value)})
        return results

    def to(self, device: str) -> None:
        pass


PLAIN_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean", list: "array",
               dict: "object", tuple: "array", type(None): "null"}


def plain_type(annotation) -> dict | None:
    """The JSON Schema of an annotation from the standard library's types (`float`,
    `list[float]`, `dict[str, int]`, `tuple[int, int]`, `Optional[str]`, `Literal["a", "b"]`,
    `Annotated[...]`), as far as it can be said; none for what cannot."""
    import typing

    if annotation is None:
        return {"type": "null"}
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return plain_type(args[0])
    if origin is typing.Literal:
        return {"enum": list(args)}
    if origin is typing.Union or type(annotation).__name__ == "UnionType":
        options = [plain_type(a) for a in args]
        return {"anyOf": options} if all(options) else None
    kind = PLAIN_TYPES.get(annotation) or PLAIN_TYPES.get(origin)
    if kind is None:
        return None
    schema = {"type": kind}
    if origin in (list, set, frozenset) or str(origin) == "<class 'collections.abc.Sequence'>":
        item = plain_type(args[0]) if args else None
        if item:
            schema["items"] = item
    elif origin is tuple and args:
        if len(args) == 2 and args[1] is Ellipsis:
            item = plain_type(args[0])
            if item:
                schema["items"] = item
        else:
            items = [plain_type(a) or {} for a in args]
            schema.update(prefixItems=items, minItems=len(items), maxItems=len(items))
    elif origin is dict and len(args) == 2:
        value = plain_type(args[1])
        if value:
            schema["additionalProperties"] = value
    return schema


def plain_schema(signature: inspect.Signature) -> dict:
    """A JSON Schema from annotations alone (no pydantic in the environment)."""
    properties, required = {}, []
    for name, p in signature.parameters.items():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        schema = plain_type(p.annotation) or {}
        if p.default is p.empty:
            required.append(name)
        else:
            schema["default"] = p.default
        properties[name] = schema
    extra = any(p.kind == p.VAR_KEYWORD for p in signature.parameters.values())
    return {"type": "object", "properties": properties, "required": required,
            "additionalProperties": extra}


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def parameter_bytes(module) -> int:
    parameters = getattr(module, "parameters", None)
    if not callable(parameters):
        return 0
    try:
        total = sum(p.numel() * p.element_size() for p in parameters())
        buffers = getattr(module, "buffers", None)
        if callable(buffers):
            total += sum(b.numel() * b.element_size() for b in buffers())
        return int(total)
    except Exception:
        return 0


# --- tracing ----------------------------------------------------------------------------------


class Tracing:
    """Joins the caller's trace when the model's environment has OpenTelemetry: the W3C context of
    each batch is current while it runs, so spans the model makes land in the rollout's trace.
    With the SDK and an OTLP endpoint configured, the host exports them itself."""

    def __init__(self):
        self.api = optional("opentelemetry.context")
        self.propagate = optional("opentelemetry.propagate") if self.api else None
        self.provider = None
        if self.propagate is not None:
            self.provider = configure_export()

    def enter(self, carrier: dict | None):
        if self.propagate is None or not carrier:
            return None
        return self.api.attach(self.propagate.extract(carrier))

    def leave(self, token) -> None:
        if token is not None:
            self.api.detach(token)

    def flush(self) -> None:
        if self.provider is not None:
            try:
                self.provider.force_flush()
                self.provider.shutdown()
            except Exception:
                pass


def configure_export():
    """A tracer provider exporting OTLP, when the environment can and the worker exports too."""
    endpoint = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    if not endpoint:
        return None
    trace = optional("opentelemetry.trace")
    sdk = optional("opentelemetry.sdk.trace")
    export = optional("opentelemetry.sdk.trace.export")
    resources = optional("opentelemetry.sdk.resources")
    if not (trace and sdk and export and resources):
        return None
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    modules = ["opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
               "opentelemetry.exporter.otlp.proto.http.trace_exporter"]
    if protocol.startswith("http"):
        modules.reverse()
    exporter = None
    for name in modules:
        module = optional(name)
        if module is not None:
            exporter = module.OTLPSpanExporter()
            break
    if exporter is None:
        return None
    resource = resources.Resource.create(
        {"service.name": os.environ.get("NOMAD_HOST_SERVICE_NAME", "nomad/model-host")}
    )
    provider = sdk.TracerProvider(resource=resource)
    provider.add_span_processor(export.BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    return provider


# --- the host ---------------------------------------------------------------------------------


class Host:
    def __init__(self):
        self.model = None
        self.tracing = Tracing()

    def handle(self, request: dict) -> dict:
        op = request.get("op")
        handler = getattr(self, f"op_{op}", None) if isinstance(op, str) else None
        if handler is None:
            raise HostError("bad_request", f"unknown op {op!r}")
        if op not in ("load", "exit") and self.model is None:
            raise HostError("bad_request", f"{op!r} before `load`")
        return handler(request)

    def op_load(self, request: dict) -> dict:
        entry = request.get("entry")
        kinds = {"model_class": ModelClass, "callable": Function}
        if entry not in kinds:
            raise HostError("bad_request", f"unknown entry {entry!r}")
        self.model = kinds[entry](request)
        if request.get("device") and request.get("instantiate", True):
            self.model.to(request["device"])
        return {"protocol": PROTOCOL_VERSION, **self.model.describe()}

    def op_batch(self, request: dict) -> dict:
        items = request.get("items")
        if not isinstance(items, list) or not items:
            raise HostError("bad_request", "`items` must be a non-empty list")
        if getattr(self.model, "tool", True) is None:
            self.model.instantiate()
        token = self.tracing.enter(request.get("trace"))
        try:
            return {"results": self.model.run(items)}
        finally:
            self.tracing.leave(token)

    def op_to(self, request: dict) -> dict:
        self.model.to(request.get("device", "cpu"))
        return {}

    def op_clear_cache(self, request: dict) -> dict:
        gc.collect()
        torch = torch_module()
        if torch is None or not torch.cuda.is_available():
            return {"released_bytes": None}
        before = torch.cuda.memory_reserved()
        torch.cuda.empty_cache()
        return {"released_bytes": max(0, before - torch.cuda.memory_reserved())}

    def op_exit(self, request: dict) -> dict:
        return {"exiting": True}


def serve(channel: Channel) -> None:
    host = Host()
    while True:
        try:
            request = channel.receive()
        except HostError as e:
            channel.send(error_reply(e))
            return
        if request is None:
            break
        if not isinstance(request, dict):
            request = {"op": None}
        try:
            reply = {"ok": host.handle(request)}
        except HostError as e:
            reply = error_reply(e)
        except BaseException as e:  # noqa: BLE001 - every failure of model code is reported
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            kind = "out_of_memory" if is_out_of_memory(e) else "failed"
            if kind == "out_of_memory":
                torch = torch_module()
                if torch is not None and torch.cuda.is_available():
                    torch.cuda.empty_cache()
            else:
                traceback.print_exc()
            reply = error_reply(HostError(kind, exception_text(e)))
        try:
            channel.send(reply)
        except OSError:
            break  # the worker is gone
        if request.get("op") == "exit":
            break
    host.tracing.flush()


def main() -> int:
    fd = os.environ.get("NOMAD_HOST_FD")
    if fd is None or not fd.isdigit():
        print("nomad_model_host: NOMAD_HOST_FD is not set; the device worker starts this host",
              file=sys.stderr)
        return 2
    for path in reversed([p for p in os.environ.get("NOMAD_HOST_PATH", "").split(os.pathsep) if p]):
        if path not in sys.path:
            sys.path.insert(0, path)
    try:
        limit = nomad_frame.limit("host")
    except RuntimeError as e:
        print(f"nomad_model_host: {e}", file=sys.stderr)
        return 2
    serve(Channel(int(fd), limit))
    return 0


if __name__ == "__main__":
    sys.exit(main())
