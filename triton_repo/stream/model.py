"""The streaming model of the tensorrt target: text in, text out token by token (Triton Python backend, decoupled,
BLS). The targets whose engine model is ours (llm_serving.py) stream text from that model through an ensemble of
it alone instead (publish.py's _stream_ensemble): no BLS hop.

For gRPC streams and the HTTP ``generate_stream`` endpoint. Per request it tokenizes the prompt itself, as the
preprocessing model does (the same code, llm_io.Prompter), calls the ``tensorrt_llm`` model with ``streaming`` on,
and turns each new token into text itself, with the tokens already shown as context (as the postprocessing model
does). A BLS call to those models, once per request and once per token, cost a round trip through another process
each (scripts/bench_stream_path.py). A token that ends inside a multi-byte character is held back until the
character is complete, so the pieces a client concatenates are exactly the full decode (llm_io.TextStream).
Requests run on threads of their own; the tokenizer is used by one at a time (a fast tokenizer's settings are
not thread-safe).

Inputs: those of the ensemble (``text_input``, ``max_tokens``; optional ``stop_words``,
``apply_chat_template``, ``temperature``, ``top_k``, ``top_p``, ``seed``, ``end_id``, ``priority``, ``tenant``;
the tenant may come in the ``x-tenant`` header instead). Outputs per
response: ``text_output`` STRING [1] (the new text) and ``output_ids`` INT32 [-1] (the tokens behind it).
Parameters: ``tensorrt_llm_model``, ``tokenizer_dir`` (relative to the version folder), and the preprocessing
model's ``add_special_tokens``, ``apply_chat_template``, ``max_input_len``, ``max_seq_len``. A bad request (empty
text, a prompt over max_input_len, max_tokens out of range) gets INVALID_ARG, as from the preprocessing model.
"""

import collections
import os
import sys
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llm_io  # noqa: E402

# This process only tokenizes: keep transformers from importing torch (3x faster to load, ~400 MB less).
os.environ["USE_TORCH"] = "0"
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # its "no PyTorch found" notice would fill the log

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
# the ensemble's inputs passed on to tensorrt_llm as its inputs (priority: only where request classes are on;
# the tenant is resolved apart, from the input or the x-tenant header)
SAMPLING = {"temperature": "temperature", "top_k": "runtime_top_k", "top_p": "runtime_top_p",
            "seed": "seed", "priority": "priority"}
# How long a finished BLS stream is kept referenced here after its last response. The stub's map of streams holds
# one too, dropped on its utils thread without the GIL (python_backend src/pb_stub.cc, SendCleanupId:
# response_iterator_map_.erase), so whichever reference goes last runs the stream's destructor, which frees its
# responses' numpy arrays: on that thread, without the GIL, when this model's went first. Kept this long, the
# map's goes first and the destructor runs here, under the GIL. (The heap corruption that wedged the streaming path
# under long concurrent load had another cause, outputs not asked for: llm_io.wanted_outputs.)
RETIRE_S = 5.0


class TritonPythonModel:
    def initialize(self, args):
        llm_io.exit_with_server()
        llm_io.stacks_on_signal()
        self.model_config, p, self.tokenizer = llm_io.load_tokenizer(args)
        self.prompter = llm_io.Prompter(self.tokenizer, p)
        self.tokenizing = threading.Lock()
        self.llm = p["tensorrt_llm_model"]
        self.tenanted = any(i["name"] == "tenant" for i in self.model_config.get("input", []))
        self._retired = collections.deque()  # (when, a finished BLS stream): see RETIRE_S
        self._retiring = threading.Lock()
        self.responder = llm_io.Responder(FINAL)  # every response sent from one thread
        llm_io.freeze_heap()  # last: what initialize made is never walked by a full collection

    def execute(self, requests):
        for request in requests:
            out = self.responder.stream(request, request.get_response_sender())
            threading.Thread(target=self._serve, args=(request, out), daemon=True).start()
        return None

    def _serve(self, request, out):
        try:
            self._generate(request, out)
        except _Failed as e:
            out.send(pb_utils.InferenceResponse(error=e.error), final=True)
        except Exception as e:  # noqa: BLE001 - the request gets the error; the model keeps serving
            out.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(
                f"{type(e).__name__}: {e}", pb_utils.TritonError.INTERNAL)), final=True)

    def _generate(self, request, out):
        llm_in = self._prompt(request)
        for ours, theirs in SAMPLING.items():
            t = pb_utils.get_input_tensor_by_name(request, ours)
            if t is not None:
                llm_in.append(pb_utils.Tensor(theirs, t.as_numpy()))
        if self.tenanted:
            try:
                llm_in += llm_io.tenant_inputs(request, pb_utils)
            except ValueError as e:
                raise _Failed(pb_utils.TritonError(str(e), pb_utils.TritonError.INVALID_ARG)) from None
        llm_in.append(pb_utils.Tensor("streaming", np.array([[True]])))
        stream = pb_utils.InferenceRequest(model_name=self.llm, inputs=llm_in,
                                           requested_output_names=["output_ids", "sequence_length"]
                                           ).exec(decoupled=True)
        text = llm_io.TextStream(self.tokenizer, self.tokenizing)
        for response in stream:
            _check(response)
            if out.cancelled:
                break  # leaving the loop drops the inner request's stream
            ids = pb_utils.get_output_tensor_by_name(response, "output_ids")
            if ids is None:
                continue  # the final flag arrives as an empty response
            n = int(pb_utils.get_output_tensor_by_name(response, "sequence_length").as_numpy().reshape(-1)[0])
            piece = text.push([int(t) for t in ids.as_numpy().reshape(-1)[:n]])
            if piece is not None:
                out.send(_piece(out.wanted, *piece))
        else:
            self._retire(stream)  # finished: its last reference is dropped here later, under the GIL
        piece = text.flush()
        if piece is not None:
            out.send(_piece(out.wanted, *piece))
        out.send(final=True)

    def _retire(self, stream):
        """Keep a finished stream referenced for RETIRE_S, dropping those retired longer ago (on this thread)."""
        now = time.monotonic()
        with self._retiring:
            self._retired.append((now, stream))
            old = []
            while self._retired and now - self._retired[0][0] > RETIRE_S:
                old.append(self._retired.popleft())
        del old  # their destructors run here, outside the lock

    def _prompt(self, request):
        """The engine model's prompt inputs, as the preprocessing model makes them (llm_io.Prompter)."""
        get = lambda name: pb_utils.get_input_tensor_by_name(request, name)  # noqa: E731
        max_tokens = int(llm_io.scalar(get("max_tokens")))
        stop = get("stop_words")
        try:
            with self.tokenizing:
                ids = self.prompter.prompt_ids(llm_io.as_str(llm_io.scalar(get("text_input"))), max_tokens,
                                               llm_io.scalar(get("apply_chat_template")))
                words = self.prompter.stop_words(stop.as_numpy().reshape(-1) if stop is not None else [])
        except ValueError as e:
            raise _Failed(pb_utils.TritonError(str(e), pb_utils.TritonError.INVALID_ARG)) from None
        end = llm_io.scalar(get("end_id"), self.prompter.eos_id)
        return [pb_utils.Tensor("input_ids", np.array([ids], dtype=np.int32)),
                pb_utils.Tensor("input_lengths", np.array([[len(ids)]], dtype=np.int32)),
                pb_utils.Tensor("request_output_len", np.array([[max_tokens]], dtype=np.int32)),
                pb_utils.Tensor("end_id", np.array([[end]], dtype=np.int32)),
                pb_utils.Tensor("pad_id", np.array([[self.prompter.pad_id]], dtype=np.int32)),
                pb_utils.Tensor("stop_words_list", words[None].astype(np.int32))]

class _Failed(Exception):
    def __init__(self, error):
        super().__init__(error.message())
        self.error = error


def _check(response):
    if response.has_error():
        raise _Failed(llm_io.relayed_error(response.error(), pb_utils))
    return response


def _piece(wanted, text, ids):
    """A response with the new text and the tokens behind it: only the outputs the request asked for
    (llm_io.wanted_outputs)."""
    tensors = []
    if "text_output" in wanted:
        tensors.append(pb_utils.Tensor("text_output", np.array([[text.encode("utf-8")]], dtype=object)))
    if "output_ids" in wanted:
        tensors.append(pb_utils.Tensor("output_ids", np.asarray(ids, dtype=np.int32).reshape(1, -1)))
    return pb_utils.InferenceResponse(tensors)
