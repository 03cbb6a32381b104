"""Live state from one replica group to another, with nothing unpickled: JSON metadata and raw tensor bytes.

A restarted torchft replica group heals from a live peer (:mod:`megazero.fault_tolerance`): each of its
ranks fetches the state of the same rank in the source group -- weights, optimizer state, the train
state -- before its first step. torchft's own transports unpickle what they receive (its HTTP transport
loads with ``weights_only=False``, its process-group transport calls ``pickle.loads``); this one sends
a state as::

    8 bytes   little-endian length n of the header
    n bytes   JSON: {"tree": the state with each tensor replaced by {"tensor": i},
                     "tensors": [{"dtype": "float32", "shape": [..], "nbytes": ..}, ...]}
    then      each tensor's raw bytes, in order

and rebuilds the tensors with :func:`torch.frombuffer`. A state is a tree of dicts (string keys),
lists, strings, numbers, booleans, None and tensors. :class:`TensorTransport` serves the state of the
step being sent over HTTP (torchft's ``CheckpointTransport`` methods: ``metadata``, ``send_checkpoint``,
``disallow_checkpoint``, ``recv_checkpoint``, ``shutdown``); reads block while no state is offered.
"""
from __future__ import annotations

import json
import socket
import struct
import threading
import urllib.request
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import BinaryIO

import torch

DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2)}
_HEADER_LENGTH = struct.Struct("<Q")


def _flatten(tree, tensors: list[torch.Tensor]):
    """``tree`` with every tensor replaced by ``{"tensor": i}`` (its index in ``tensors``, appended)."""
    if isinstance(tree, torch.Tensor):
        tensors.append(tree)
        return {"tensor": len(tensors) - 1}
    if isinstance(tree, dict):
        if "tensor" in tree or not all(isinstance(k, str) for k in tree):
            raise TypeError(f"a state's dicts take string keys other than 'tensor', got {sorted(map(str, tree))}")
        return {k: _flatten(v, tensors) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [_flatten(v, tensors) for v in tree]
    if tree is None or isinstance(tree, (str, bool, int, float)):
        return tree
    raise TypeError(f"a state holds tensors, dicts, lists, strings, numbers and None, not {type(tree).__name__}")


def _unflatten(tree, tensors: list[torch.Tensor]):
    if isinstance(tree, dict):
        if set(tree) == {"tensor"}:
            return tensors[tree["tensor"]]
        return {k: _unflatten(v, tensors) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_unflatten(v, tensors) for v in tree]
    return tree


def _raw(t: torch.Tensor) -> memoryview:
    """The bytes of ``t`` (on the host, contiguous) without a copy where it already is."""
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def write_state(state, out: BinaryIO) -> int:
    """Write ``state`` to ``out`` in the format of the module docstring; returns the bytes written."""
    tensors: list[torch.Tensor] = []
    tree = _flatten(state, tensors)
    described = []
    for t in tensors:
        name = str(t.dtype).removeprefix("torch.")
        if name not in DTYPES:
            raise TypeError(f"tensors of dtype {t.dtype} are not sent")
        described.append({"dtype": name, "shape": list(t.shape), "nbytes": t.numel() * t.element_size()})
    header = json.dumps({"tree": tree, "tensors": described}).encode()
    out.write(_HEADER_LENGTH.pack(len(header)))
    out.write(header)
    for t in tensors:
        out.write(_raw(t))
    return _HEADER_LENGTH.size + len(header) + sum(d["nbytes"] for d in described)


def _read_exactly(source: BinaryIO, n: int) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        chunk = source.readinto(view[got:])
        if not chunk:
            raise ConnectionError(f"the state ended after {got} of {n} bytes")
        got += chunk
    return buf


def read_state(source: BinaryIO):
    """The state :func:`write_state` wrote, its tensors rebuilt from the raw bytes (no unpickling)."""
    (length,) = _HEADER_LENGTH.unpack(_read_exactly(source, _HEADER_LENGTH.size))
    header = json.loads(_read_exactly(source, length).decode())
    body = _read_exactly(source, sum(d["nbytes"] for d in header["tensors"]))
    tensors, offset = [], 0
    for d in header["tensors"]:
        dtype, shape, n = DTYPES[d["dtype"]], d["shape"], d["nbytes"]
        if n:
            raw = torch.frombuffer(body, dtype=torch.uint8, count=n, offset=offset)
            aligned = raw if offset % 8 == 0 else raw.clone()       # a dtype view needs an aligned start
            t = aligned.view(dtype).reshape(shape)
        else:
            t = torch.empty(shape, dtype=dtype)
        tensors.append(t)
        offset += n
    return _unflatten(header["tree"], tensors)


class TensorTransport:
    """torchft's checkpoint transport for a healing replica group, over HTTP, in the format above.

    ``send_checkpoint(dst_ranks, step, state, timeout)`` offers ``state`` (its tensors are read when a peer
    asks, so the caller leaves them untouched until ``disallow_checkpoint()``, which waits for reads under
    way); ``recv_checkpoint(src_rank, metadata, step, timeout)`` fetches step ``step`` from the peer whose
    ``metadata()`` (its address) is ``metadata``.
    """

    def __init__(self, timeout: timedelta, host: str | None = None):
        self._timeout = timeout
        self._state, self._step = None, -1
        self._offered = threading.Condition()
        self._readers = 0
        transport = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):                                  # noqa: N802 - http.server's name
                transport._serve(self)

            def log_message(self, *args):                      # quiet: the trainer's log says what matters
                pass

        self._server = ThreadingHTTPServer(("", 0), Handler)
        self._server.daemon_threads = True
        self._host = host or socket.gethostname()
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True, name="state_transport")
        self._thread.start()

    def metadata(self) -> str:
        return f"http://{self._host}:{self._server.server_address[1]}/state/"

    def _serve(self, request: BaseHTTPRequestHandler) -> None:
        step = request.path.rstrip("/").rsplit("/", 1)[-1]
        with self._offered:
            offered = self._offered.wait_for(lambda: self._state is not None and str(self._step) == step,
                                             timeout=self._timeout.total_seconds())
            if not offered:
                request.send_error(404, f"step {step} is not offered here (offering {self._step})")
                return
            state = self._state
            self._readers += 1
        try:
            request.send_response(200)
            request.send_header("Content-type", "application/octet-stream")
            request.end_headers()
            write_state(state, request.wfile)
        finally:
            with self._offered:
                self._readers -= 1
                self._offered.notify_all()

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict, timeout: timedelta) -> None:
        with self._offered:
            self._state, self._step = state_dict, step
            self._offered.notify_all()

    def disallow_checkpoint(self) -> None:
        """No more reads of the offered state: returns once those under way are written."""
        with self._offered:
            self._state = None
            self._offered.wait_for(lambda: self._readers == 0, timeout=self._timeout.total_seconds())

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta):
        with urllib.request.urlopen(f"{metadata}{step}", timeout=timeout.total_seconds()) as response:
            return read_state(response)

    def shutdown(self, wait: bool = True) -> None:
        self._server.shutdown()
        self._server.server_close()
