"""Helpers shared by the Triton Python models (copied into each model's version folder by publish).

Plain numpy and the standard library: this file runs inside the Triton Python-backend stub, in whatever
environment serves the models, and must not import the pipeline package.
"""

from __future__ import annotations

import json
import os
import re
from typing import Optional

import numpy as np

# TensorRT-LLM's stop/bad-words layout: [2, L] per request: row 0 the token ids of all words back to back
# (padded with 0), row 1 the end offset of each word (padded with -1).
WORDS_PAD_ID, WORDS_PAD_OFFSET = 0, -1
REPLACEMENT_CHAR = "\ufffd"  # what a tokenizer's decode gives for an incomplete UTF-8 sequence


PARENT_CHECK_S = 1
CANCEL_CHECK_S = 0.2  # how often a streaming request asks the server whether its client cancelled it (CancelCheck)
STACKS_SIGNAL = "SIGUSR1"  # asks a stub for every Python thread's stack, on its stderr (the server's log)


def exit_with_server() -> None:
    """End this Python-backend stub as soon as its tritonserver is gone.

    A server killed hard (or killed with the pipeline that started it) can leave its stubs behind: the stub of
    a model holding a loaded runtime stayed alive as an orphan (1.26 GB each time), its threads stuck where
    no Python code runs again (a watchdog thread of our own never got the interpreter back). So every model
    starts, in ``initialize``, a tiny shell watcher outside the interpreter: while the stub's parent is still
    the server it sleeps; once the stub has been reparented (the server died) it SIGKILLs the stub, then ends.
    It ends with the stub too (an unloaded model), and a server stopping normally takes it down with its group."""
    import subprocess

    server, stub = os.getppid(), os.getpid()
    watch = (f'while read -r _ _ _ ppid _ < /proc/{stub}/stat && [ "$ppid" = "{server}" ]; '
             f"do sleep {PARENT_CHECK_S}; done; [ -r /proc/{stub}/stat ] && kill -9 {stub}")
    subprocess.Popen(["/bin/sh", "-c", watch], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL, close_fds=True)


def stacks_on_signal() -> None:
    """On STACKS_SIGNAL, write every Python thread's stack to stderr, which the stub shares with its server (the
    server's log), and go on serving. The pipeline sends it to a server's stubs when requests time out
    (``TritonServer.dump_python_stacks``): where a request waits is then in the log, not guessed at."""
    import faulthandler
    import signal
    import sys

    faulthandler.register(getattr(signal, STACKS_SIGNAL), file=sys.stderr, all_threads=True, chain=False)


class CancelCheck:
    """Whether the client cancelled ``request``, asked of the server at most every CANCEL_CHECK_S.

    ``request.is_cancelled()`` is a synchronous round trip to the server, handled there on the one thread that takes
    every message of the model's stub (python_backend's StubToParentMQMonitor). Asked once per token by every
    stream it is the stub's busiest message, and with 16 streams the server's side of a streaming model and of the
    engine model under it was seen wedged, every stream waiting (scripts/bench_stream_path.py, TritonServer's stack
    dump). A cancelled stream now stops within CANCEL_CHECK_S, not within a token."""

    def __init__(self, request):
        self.request, self.next_s = request, 0.0

    def __call__(self) -> bool:
        import time

        now = time.monotonic()
        if now < self.next_s:
            return False
        self.next_s = now + CANCEL_CHECK_S
        return self.request.is_cancelled()


class Responder:
    """Sends every response of a model from one thread of its own, in the order each request queued them, and asks
    there whether a stream's client cancelled it (CancelCheck, after each of its responses): a request thread only
    queues its responses (``stream(request, sender)``) and never waits on ``sender.send``, a synchronous round trip
    to the server. Upstream's vllm_backend does the same (src/model.py, ``_response_loop``). ``final_flag``:
    pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL (this file does not import pb_utils)."""

    def __init__(self, final_flag: int):
        import queue
        import threading

        self.final_flag = final_flag
        self._queue: "queue.SimpleQueue" = queue.SimpleQueue()
        threading.Thread(target=self._loop, name="responder", daemon=True).start()

    def stream(self, request, sender) -> "ResponseStream":
        return ResponseStream(self._queue.put, request, sender)

    def _loop(self) -> None:
        import sys

        while True:
            stream, response, final = self._queue.get()
            try:
                flags = self.final_flag if final else 0
                if response is None:
                    stream.sender.send(flags=flags)
                else:
                    stream.sender.send(response, flags=flags)
                if not final and not stream.cancelled:
                    stream.cancelled = stream.check()
            except Exception as e:  # noqa: BLE001 - one request's failure; the others are still sent
                print(f"responder: a response could not be sent: {type(e).__name__}: {e}", file=sys.stderr)
            del stream, response  # dropped here, under the GIL, before the next wait


class ResponseStream:
    """One request's responses, in order, through its model's Responder. ``cancelled``: whether its client
    cancelled it, as the responder last asked (at most every CANCEL_CHECK_S). ``wanted``: the outputs the request
    asked for (Triton's core lists them all where the client named none), see wanted_outputs."""

    def __init__(self, put, request, sender):
        self._put, self.sender, self.check = put, sender, CancelCheck(request)
        self.cancelled = False
        self.wanted = wanted_outputs(request)

    def send(self, response=None, final: bool = False) -> None:
        """Queue ``response`` (None: the final flag alone, with ``final``)."""
        self._put((self, response, final))


def wanted_outputs(request) -> frozenset:
    """The outputs ``request`` asked for. A response must carry those and no other: python_backend's
    ``ResponseSender::Send`` releases the GIL and then erases the outputs the request did not ask for
    (``InferResponse::PruneOutputTensors``, r24.10 src/response_sender.cc), and a tensor freed there frees its numpy
    arrays without the GIL. That corrupted the heap: an ensemble step asks only for the outputs it maps, and the
    vllm engine model's stub died in CPython's allocator after about 3 minutes of streams (scripts/soak_stream.py)."""
    return frozenset(request.requested_output_names())


def freeze_heap() -> int:
    """Collect once, then move every object the model has made so far out of the garbage collector's reach
    (``gc.freeze``); returns how many. Called last in each model's ``initialize``, as vLLM's own server does once
    it is up (vllm/entrypoints/launchers/utils/server_utils.py, ``freeze_gc_heap``).

    A stub that has imported vLLM or torch holds about 650,000 tracked objects. Without this, every full collection
    walks all of them while serving: 0.34-0.9 s measured in the vLLM engine model's stub under load, and every
    stream of that model stalls for as long (scripts/bench_stream_path.py --target vllm). Objects made after the
    freeze are collected as usual."""
    import gc

    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def load_tokenizer(args: dict):
    """(model config, its parameters, the tokenizer in ``tokenizer_dir`` of the version folder) for a
    Python model's ``initialize(args)``."""
    import json
    from pathlib import Path

    from transformers import AutoTokenizer

    model_config = json.loads(args["model_config"])
    p = parameters(model_config)
    version_dir = Path(args["model_repository"]) / args["model_version"]
    return model_config, p, AutoTokenizer.from_pretrained(str(version_dir / p["tokenizer_dir"]))


class Prompter:
    """Text in, the engine model's inputs out, for one prompt: the preprocessing model's work, shared with the
    streaming model, which tokenizes with its own tokenizer copy rather than by a BLS call to preprocessing (one
    round trip through another process per request: scripts/bench_stream_path.py). Built from the model's
    tokenizer and its parameters ``add_special_tokens``, ``apply_chat_template`` (the default where a request
    sends none), ``max_input_len`` and ``max_seq_len``. A bad request is a ValueError saying what to send."""

    def __init__(self, tokenizer, params: dict[str, str]):
        self.tokenizer = tokenizer
        self.add_special_tokens = params.get("add_special_tokens", "true") == "true"
        self.chat_default = params.get("apply_chat_template", "false") == "true"
        self.max_input_len = int(params["max_input_len"])
        self.max_seq_len = int(params["max_seq_len"])
        self.eos_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_id

    def prompt_ids(self, text: str, max_tokens: int, chat: Optional[bool] = None) -> list[int]:
        """The prompt's token ids, checked with ``max_tokens`` against the build's limits."""
        if not text:
            raise ValueError("text_input is empty: send the prompt text")
        if self.chat_default if chat is None else bool(chat):
            if not getattr(self.tokenizer, "chat_template", None):
                raise ValueError("apply_chat_template was asked for, but this model's tokenizer has no chat template")
            row = self.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                     tokenize=True)
        else:
            row = self.tokenizer(text, add_special_tokens=self.add_special_tokens).input_ids
        if len(row) > self.max_input_len:
            raise ValueError(f"the prompt is {len(row)} tokens; this model accepts at most max_input_len="
                             f"{self.max_input_len}")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        if len(row) + max_tokens > self.max_seq_len:
            raise ValueError(f"prompt ({len(row)} tokens) + max_tokens ({max_tokens}) exceeds max_seq_len="
                             f"{self.max_seq_len}; ask for at most {self.max_seq_len - len(row)} tokens")
        return list(row)

    def stop_words(self, words) -> np.ndarray:
        """The [2, L] stop-words tensor of the stop strings (empty ones skipped)."""
        return words_to_list([self.tokenizer(w, add_special_tokens=False).input_ids
                              for w in (as_str(w) for w in words) if w])


def parameters(model_config: dict) -> dict[str, str]:
    """The model config's ``parameters`` as plain strings."""
    return {k: v.get("string_value", "") for k, v in model_config.get("parameters", {}).items()}


def words_to_list(word_ids: list[list[int]]) -> np.ndarray:
    """[[ids of word 1], [ids of word 2], ...] -> the [2, L] stop-words tensor."""
    flat, offsets = [], []
    for ids in word_ids:
        if ids:
            flat += ids
            offsets.append(len(flat))
    width = max(1, len(flat))
    out = np.full((2, width), WORDS_PAD_OFFSET, dtype=np.int32)
    out[0, :] = WORDS_PAD_ID
    out[0, : len(flat)] = flat
    out[1, : len(offsets)] = offsets
    return out


def list_to_words(words: Optional[np.ndarray]) -> list[list[int]]:
    """The [2, L] stop-words tensor -> [[ids of word 1], ...] (the inverse of words_to_list)."""
    if words is None:
        return []
    words = np.asarray(words).reshape(2, -1)
    out, start = [], 0
    for end in words[1]:
        end = int(end)
        if end < 0:
            break
        if end > start:
            out.append([int(t) for t in words[0, start:end]])
        start = end
    return out


def ends_with_any(ids: list[int], sequences: list[list[int]]) -> bool:
    return any(len(ids) >= len(s) and ids[len(ids) - len(s):] == s for s in sequences)


def decode_delta(tokenizer, prefix_ids: list[int], ids: list[int]) -> str:
    """The text that ``ids`` add after ``prefix_ids`` (tokens already shown): decoding them in context gets
    the leading space and merged bytes right, where decoding them alone would not."""
    if not ids:
        return ""
    if not prefix_ids:
        return decode(tokenizer, ids)
    before = decode(tokenizer, prefix_ids)
    both = decode(tokenizer, prefix_ids + ids)
    if both.startswith(before) and not before.endswith(REPLACEMENT_CHAR):
        return both[len(before):]
    return decode(tokenizer, ids)


class TextStream:
    """One request's tokens turned into text as they come (the streaming models' incremental detokenizer): each
    new token is decoded in the context of the last CONTEXT_TOKENS already shown (decode_delta), and a token that
    ends inside a multi-byte character is held back until the character is complete, so the pieces a client
    concatenates are exactly the full decode. ``lock``: held around each decode (a fast tokenizer's settings are
    not thread-safe, and request threads share one)."""

    CONTEXT_TOKENS = 8

    def __init__(self, tokenizer, lock):
        self.tokenizer, self.lock = tokenizer, lock
        self.shown: list[int] = []
        self.pending: list[int] = []

    def push(self, ids: list[int]) -> Optional[tuple[str, list[int]]]:
        """The next piece, (text, the tokens behind it), once ``ids`` complete one; None while held back."""
        self.pending += ids
        text = self._text()
        if text.endswith(REPLACEMENT_CHAR):
            return None  # a character split across tokens: wait for the rest of it
        return self._shown(text)

    def flush(self) -> Optional[tuple[str, list[int]]]:
        """What is still held back at the end (an incomplete character as the tokenizer decodes it), or None."""
        return self._shown(self._text()) if self.pending else None

    def whole(self, ids: list[int]) -> str:
        """The text of ``ids`` at once (a request answered in one response)."""
        with self.lock:
            return decode(self.tokenizer, ids)

    def _text(self) -> str:
        with self.lock:
            return decode_delta(self.tokenizer, self.shown, self.pending)

    def _shown(self, text: str) -> tuple[str, list[int]]:
        piece = (text, self.pending)
        self.shown, self.pending = (self.shown + self.pending)[-self.CONTEXT_TOKENS:], []  # the context kept
        return piece


def decode(tokenizer, ids: list[int]) -> str:
    """The text of ``ids`` as served: special tokens (EOS) dropped, no clean-up of spaces (a clean-up
    would make the streamed pieces differ from the whole)."""
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def as_str(value) -> str:
    return value.decode("utf-8") if isinstance(value, (bytes, bytearray)) else str(value)


# A model calling another through BLS gets the callee's error with its code reset (triton-inference-server/server
# issue 7804: always INTERNAL), so the models that relay the engine model's errors (unary, stream) restore the code
# from the message, which llm_serving.py words by kind: a request refused for now (a tenant at its limit, the
# watchdog's stop) carries one of UNAVAILABLE_MARKS, an engine failure starts with its exception's class name, and
# anything else is the client's input (INVALID_ARG).
RETRY_MARK = "; retry after "
NOT_READY = "the model is not ready"
UNAVAILABLE_MARKS = (RETRY_MARK, NOT_READY)
_FAILURE = re.compile(r"^[A-Za-z_]\w*(Error|Exception|Interrupt|Exit): ")


def relayed_error(error, pb_utils):
    """The error to send on for one a BLS call to the engine model returned, its code restored (see RETRY_MARK)."""
    message = error.message()
    if any(mark in message for mark in UNAVAILABLE_MARKS):
        code = pb_utils.TritonError.UNAVAILABLE
    elif _FAILURE.match(message):
        code = pb_utils.TritonError.INTERNAL
    else:
        code = pb_utils.TritonError.INVALID_ARG
    return pb_utils.TritonError(message, code)


TENANT_HEADER = "x-tenant"  # pipeline.tenancy.TENANT_HEADER


def request_tenant(request, tensor) -> str:
    """The tenant a request names ("": none): its ``tenant`` input, or the TENANT_HEADER header tritonserver
    forwarded as a request parameter. A ValueError where the two name different tenants."""
    body = as_str(scalar(tensor, b""))
    try:
        params = json.loads(request.parameters() or "{}")
    except ValueError:
        params = {}
    header = next((as_str(v) for k, v in params.items() if k.lower() == TENANT_HEADER), "")
    if header and body and header != body:
        raise ValueError(f"the request names tenant {body!r} in its tenant input and {header!r} in its "
                         f"{TENANT_HEADER} header: send one of them, or the same tenant in both")
    return header or body


def tenant_inputs(request, pb_utils) -> list:
    """The ``tenant`` input to pass on to the engine model ([] for none) for a relaying model: its own input or the
    header, which tritonserver hands to the model the client called and no further. ValueError as request_tenant."""
    tenant = request_tenant(request, pb_utils.get_input_tensor_by_name(request, "tenant"))
    return [pb_utils.Tensor("tenant", np.array([[tenant.encode()]], dtype=object))] if tenant else []


def scalar(tensor, default=None):
    """The first element of an optional [batch, 1] input (None when the request omitted it); a BYTES input's is
    the bytes object itself (its array holds objects, not numpy scalars)."""
    if tensor is None:
        return default
    arr = tensor.as_numpy() if hasattr(tensor, "as_numpy") else np.asarray(tensor)
    if not arr.size:
        return default
    first = arr.reshape(-1)[0]
    return first.item() if isinstance(first, np.generic) else first

