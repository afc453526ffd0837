"""postprocessing: token ids -> text, incrementally when streaming (Triton Python backend).

Inputs (with the batch dimension): ``output_ids`` INT32 [-1, -1] (beams x tokens), ``sequence_length`` INT32
[-1] (valid tokens per beam); optional ``prefix_ids`` INT32 [-1]: tokens of the same sequence already turned
into text. With a prefix, ``text_output`` is only what the new tokens add after it, decoded in its context
(a streaming client concatenates the pieces and gets exactly the full decode: leading spaces and characters
split across tokens come out right). Special tokens (EOS) are not rendered.
Output: ``text_output`` STRING [-1] (one string per beam).
Parameters: ``tokenizer_dir`` (relative to the version folder).
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


class TritonPythonModel:
    def initialize(self, args):
        llm_io.exit_with_server()
        llm_io.stacks_on_signal()
        self.model_config, _, self.tokenizer = llm_io.load_tokenizer(args)
        llm_io.freeze_heap()  # last: what initialize made is never walked by a full collection

    def execute(self, requests):
        responses = []
        for request in requests:
            ids = pb_utils.get_input_tensor_by_name(request, "output_ids").as_numpy()
            batch = ids.shape[0]
            ids = ids.reshape(batch, -1, ids.shape[-1])
            lengths = pb_utils.get_input_tensor_by_name(request, "sequence_length").as_numpy().reshape(batch, -1)
            prefix = pb_utils.get_input_tensor_by_name(request, "prefix_ids")
            prefix = prefix.as_numpy().reshape(batch, -1) if prefix is not None else None
            texts = np.empty((batch, ids.shape[1]), dtype=object)
            for b in range(batch):
                context = [int(t) for t in prefix[b]] if prefix is not None else []
                for beam in range(ids.shape[1]):
                    n = int(lengths[b, beam])
                    new = [int(t) for t in ids[b, beam, :n]]
                    texts[b, beam] = llm_io.decode_delta(self.tokenizer, context, new).encode("utf-8")
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("text_output", texts)]))
        return responses
