"""preprocessing: text -> token ids, with the model's own tokenizer (Triton Python backend).

Inputs (each with the batch dimension): ``text_input`` STRING [1], ``max_tokens`` INT32 [1]; optional
``stop_words`` STRING [-1] (strings that end generation), ``apply_chat_template`` BOOL [1] (wrap the text as
one user turn of the tokenizer's chat template; default: the ``apply_chat_template`` parameter), ``end_id``
INT32 [1] (overrides the tokenizer's EOS); with tenants, ``tenant`` STRING [1].
Outputs: ``input_ids`` INT32 [-1] (padded with ``pad_id`` across a batch), ``input_lengths`` INT32 [1],
``request_output_len`` INT32 [1], ``end_id`` INT32 [1], ``pad_id`` INT32 [1], ``stop_words_list`` INT32 [2, -1]
(TensorRT-LLM's layout); with tenants (a ``tenant`` output in the config), ``tenant`` STRING [1]: the
request's tenant input or its ``x-tenant`` header (the ensemble hands headers to its first step alone, this one),
"" for none.
Parameters: ``tokenizer_dir`` (relative to the version folder), ``add_special_tokens``,
``apply_chat_template``, ``max_input_len``, ``max_seq_len``.

A bad request (empty text, a prompt over max_input_len, max_tokens < 1 or beyond what max_seq_len leaves)
gets an INVALID_ARG error: a 400 over HTTP, not a server fault.
"""

import os
import sys

import numpy as np
import triton_python_backend_utils as pb_utils

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llm_io  # noqa: E402

# This process only tokenizes: keep transformers from importing torch (3x faster to load, ~400 MB less).
os.environ["USE_TORCH"] = "0"
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # its "no PyTorch found" notice would fill the log


class BadRequest(ValueError):
    pass


class TritonPythonModel:
    def initialize(self, args):
        llm_io.exit_with_server()
        llm_io.stacks_on_signal()
        self.model_config, p, tokenizer = llm_io.load_tokenizer(args)
        self.prompter = llm_io.Prompter(tokenizer, p)
        self.tenanted = any(o["name"] == "tenant" for o in self.model_config.get("output", []))
        llm_io.freeze_heap()  # last: what initialize made is never walked by a full collection

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                responses.append(self._one(request))
            except BadRequest as e:
                responses.append(pb_utils.InferenceResponse(
                    error=pb_utils.TritonError(str(e), pb_utils.TritonError.INVALID_ARG)))
        return responses

    def _one(self, request):
        get = lambda name: pb_utils.get_input_tensor_by_name(request, name)  # noqa: E731
        texts = get("text_input").as_numpy()
        batch = texts.shape[0]
        texts = texts.reshape(batch, -1)
        max_tokens = get("max_tokens").as_numpy().reshape(batch, -1)[:, 0]
        stop = get("stop_words")
        stop = stop.as_numpy().reshape(batch, -1) if stop is not None else None
        chat = get("apply_chat_template")
        chat = chat.as_numpy().reshape(batch, -1)[:, 0] if chat is not None else [None] * batch
        end = get("end_id")
        end = end.as_numpy().reshape(batch, -1)[:, 0] if end is not None else [self.prompter.eos_id] * batch
        try:
            tenant = llm_io.request_tenant(request, get("tenant")) if self.tenanted else ""
            ids = [self.prompter.prompt_ids(llm_io.as_str(texts[i, 0]), int(max_tokens[i]), chat[i])
                   for i in range(batch)]
        except ValueError as e:
            raise BadRequest(str(e)) from None
        words = [self.prompter.stop_words(stop[i] if stop is not None else []) for i in range(batch)]

        width = max(len(r) for r in ids)
        input_ids = np.full((batch, width), self.prompter.pad_id, dtype=np.int32)
        for i, r in enumerate(ids):
            input_ids[i, : len(r)] = r
        wwidth = max(w.shape[1] for w in words)
        stop_list = np.zeros((batch, 2, wwidth), dtype=np.int32)
        stop_list[:, 1, :] = llm_io.WORDS_PAD_OFFSET
        for i, w in enumerate(words):
            stop_list[i, :, : w.shape[1]] = w
        out = [
            pb_utils.Tensor("input_ids", input_ids),
            pb_utils.Tensor("input_lengths", np.array([[len(r)] for r in ids], dtype=np.int32)),
            pb_utils.Tensor("request_output_len", max_tokens.astype(np.int32).reshape(batch, 1)),
            pb_utils.Tensor("end_id", np.asarray(end, dtype=np.int32).reshape(batch, 1)),
            pb_utils.Tensor("pad_id", np.full((batch, 1), self.prompter.pad_id, dtype=np.int32)),
            pb_utils.Tensor("stop_words_list", stop_list.astype(np.int32)),
        ]
        if self.tenanted:
            out.append(pb_utils.Tensor("tenant", np.full((batch, 1), tenant.encode(), dtype=object)))
        return pb_utils.InferenceResponse(output_tensors=out)
