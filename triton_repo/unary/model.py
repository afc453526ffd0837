"""The ``tensorrt_llm`` model seen as one request -> one response, for the ensemble (Python backend, BLS).

Triton counts an ensemble with a decoupled step as decoupled, and then refuses it on the HTTP and gRPC infer
endpoints (501 / UNIMPLEMENTED). ``tensorrt_llm`` is decoupled so that it can stream; the ensemble calls this
model instead, which forwards each request to ``tensorrt_llm`` with ``streaming`` off and answers with its
single response. Same inputs and outputs as ``tensorrt_llm``. Each request is answered from its own thread
(the response sender works in default mode too), so requests are not serialized here.
Parameters: ``tensorrt_llm_model``.
"""

import json
import os
import sys
import threading

import triton_python_backend_utils as pb_utils

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llm_io  # noqa: E402

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
INPUTS = ("input_ids", "input_lengths", "request_output_len", "end_id", "pad_id", "stop_words_list", "temperature",
          "runtime_top_k", "runtime_top_p", "seed", "priority")


class TritonPythonModel:
    def initialize(self, args):
        llm_io.exit_with_server()
        llm_io.stacks_on_signal()
        config = json.loads(args["model_config"])
        self.llm = llm_io.parameters(config)["tensorrt_llm_model"]
        self.tenanted = any(i["name"] == "tenant" for i in config.get("input", []))
        llm_io.freeze_heap()  # last: what initialize made is never walked by a full collection

    def execute(self, requests):
        for request in requests:
            threading.Thread(target=self._forward, args=(request, request.get_response_sender()), daemon=True).start()
        return None

    def _forward(self, request, sender):
        wanted = llm_io.wanted_outputs(request)
        try:
            inputs = [t for t in (pb_utils.get_input_tensor_by_name(request, n) for n in INPUTS) if t is not None]
            if self.tenanted:
                try:
                    inputs += llm_io.tenant_inputs(request, pb_utils)
                except ValueError as e:
                    sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(
                        str(e), pb_utils.TritonError.INVALID_ARG)), flags=FINAL)
                    return
            stream = pb_utils.InferenceRequest(model_name=self.llm, inputs=inputs,
                                               requested_output_names=["output_ids", "sequence_length"]
                                               ).exec(decoupled=True)
            answer = None
            for response in stream:
                if response.has_error():
                    answer = pb_utils.InferenceResponse(error=llm_io.relayed_error(response.error(), pb_utils))
                    break
                if pb_utils.get_output_tensor_by_name(response, "output_ids") is not None:
                    # only the outputs asked for: one more would be freed without the GIL (llm_io.wanted_outputs)
                    answer = pb_utils.InferenceResponse(output_tensors=[
                        t for t in response.output_tensors() if t.name() in wanted])
            if answer is None:
                answer = pb_utils.InferenceResponse(error=pb_utils.TritonError(
                    f"{self.llm} gave no response", pb_utils.TritonError.INTERNAL))
            sender.send(answer, flags=FINAL)
        except Exception as e:  # noqa: BLE001 - the request gets the error; the model keeps serving
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(
                f"{type(e).__name__}: {e}", pb_utils.TritonError.INTERNAL)), flags=FINAL)
